"""GLM-4.1V, GLM-4.6V-Flash and GLMGA: three variants of one family (shared vision tower and decoder).

They differ in their processors: the frame-sampling rule, the video timestamp format and the
size limits. Each variant is a `Family`; which one serves a checkpoint is read from its config's
`model_type` and its video processor's class (`detect_family`), never from a name a user types.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_vlm.families.base import Family, chat_template

IMAGE_TOKEN, VIDEO_TOKEN = "<|image|>", "<|video|>"
BEGIN_IMAGE, END_IMAGE = "<|begin_of_image|>", "<|end_of_image|>"
BEGIN_VIDEO, END_VIDEO = "<|begin_of_video|>", "<|end_of_video|>"
ENDOFTEXT, USER, ASSISTANT, OBSERVATION = "<|endoftext|>", "<|user|>", "<|assistant|>", "<|observation|>"
SPECIAL_TOKENS = (ENDOFTEXT, "[gMASK]", "<sop>", "<|system|>", USER, ASSISTANT, OBSERVATION,
                  BEGIN_IMAGE, END_IMAGE, BEGIN_VIDEO, END_VIDEO, IMAGE_TOKEN, VIDEO_TOKEN)
# What generation stops on, as in the released checkpoints' generation_config.json.
EOS_TOKENS = (ENDOFTEXT, USER, OBSERVATION)

# GLM's chat template, reduced to what the demo needs.
CHAT_TEMPLATE = chat_template(
    prefix="[gMASK]<sop>", message_start="<|{{ message['role'] }}|>\n", message_end="",
    image=BEGIN_IMAGE + IMAGE_TOKEN + END_IMAGE, video=BEGIN_VIDEO + VIDEO_TOKEN + END_VIDEO,
    generation_prompt="<|assistant|>\n")

# Random-weight demo shapes. Rotary covers half of each head (`partial_rotary_factor` 0.5), so
# `mrope_section` sums to head_dim / 4. `image_size` sets the learned position-embedding grid that
# the tower interpolates to every image's patch grid.
DEMO_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, mrope_section=[2, 3, 3]),
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, image_size=112),
        image_pixels=(112 * 112, 256 * 28 * 28), video_pixels=(112 * 112, 2 * 64 * 28 * 28),
    ),
    "small": dict(
        vocab_size=8192,
        text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, mrope_section=[4, 6, 6]),
        vision=dict(depth=8, hidden_size=256, intermediate_size=704, num_heads=4, image_size=336),
        image_pixels=(112 * 112, 1024 * 28 * 28), video_pixels=(112 * 112, 2 * 256 * 28 * 28),
    ),
}


@dataclass(frozen=True)
class Variant:
    """What one GLM variant's checkpoint is made of: its transformers class names."""
    config_class: str
    model_class: str
    processor_class: str
    image_processor_class: str
    video_processor_class: str


VARIANTS: dict[str, Variant] = {
    "glm4v": Variant("Glm4vConfig", "Glm4vForConditionalGeneration", "Glm4vProcessor",
                     "Glm4vImageProcessor", "Glm4vVideoProcessor"),
    "glm46v": Variant("Glm46VConfig", "Glm46VForConditionalGeneration", "Glm46VProcessor",
                      "Glm46VImageProcessor", "Glm46VVideoProcessor"),
    "glmga": Variant("GlmgaConfig", "Glm46VForConditionalGeneration", "Glm46VProcessor",
                     "GlmgaImageProcessor", "GlmgaVideoProcessor"),
}


def write_demo(out: Path, size: str, tokenizer, seed: int, *, variant: str) -> None:
    """Write a random-weight checkpoint of `variant` that transformers loads offline."""
    import torch
    import transformers
    from transformers import GenerationConfig

    names = VARIANTS[variant]
    shape = DEMO_SIZES[size]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    eos_ids = [ids[t] for t in EOS_TOKENS]
    text = dict(shape["text"])
    mrope_section = text.pop("mrope_section")
    config = getattr(transformers, names.config_class)(
        text_config=dict(
            vocab_size=len(tokenizer), max_position_embeddings=4096, rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=mrope_section,
                                 partial_rotary_factor=0.5),
            eos_token_id=eos_ids, pad_token_id=ids[ENDOFTEXT], **text),
        vision_config=dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           out_hidden_size=text["hidden_size"], rms_norm_eps=1e-5, **shape["vision"]),
        image_token_id=ids[IMAGE_TOKEN], video_token_id=ids[VIDEO_TOKEN],
        image_start_token_id=ids[BEGIN_IMAGE], image_end_token_id=ids[END_IMAGE],
        video_start_token_id=ids[BEGIN_VIDEO], video_end_token_id=ids[END_VIDEO],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, names.model_class)(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=ids[ENDOFTEXT],
                                               do_sample=False)
    model.save_pretrained(out)

    (img_min, img_max), (vid_min, vid_max) = shape["image_pixels"], shape["video_pixels"]
    image_processor = getattr(transformers, names.image_processor_class)(
        size={"shortest_edge": img_min, "longest_edge": img_max})
    video_processor = getattr(transformers, names.video_processor_class)(
        size={"shortest_edge": vid_min, "longest_edge": vid_max})
    processor = getattr(transformers, names.processor_class)(
        image_processor=image_processor, video_processor=video_processor, tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)


def encoder_dims(config: dict) -> tuple[int, int]:
    vision = config["vision_config"]
    patch_dim = vision.get("in_channels", 3) * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    return patch_dim, vision["out_hidden_size"]


def _family(name: str, model_types: tuple[str, ...]) -> Family:
    from functools import partial

    return Family(
        name=name,
        model_types=model_types,
        video_processor_types=(VARIANTS[name].video_processor_class,),
        image_placeholder=BEGIN_IMAGE + IMAGE_TOKEN + END_IMAGE,
        video_placeholder=BEGIN_VIDEO + VIDEO_TOKEN + END_VIDEO,
        special_tokens=SPECIAL_TOKENS,
        eos_tokens=EOS_TOKENS,
        named_special_tokens={"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN},
        encoder_dims=encoder_dims,
        demo_sizes=DEMO_SIZES,
        write_demo=partial(write_demo, variant=name),
        chat_template=CHAT_TEMPLATE,
    )


# Released GLM-4.6V-Flash and GLMGA checkpoints may say `model_type: glm4v`; their video processor
# tells them apart.
GLM4V = _family("glm4v", ("glm4v",))
GLM46V = _family("glm46v", ("glm46v", "glm4v"))
GLMGA = _family("glmga", ("glmga", "glm4v"))
