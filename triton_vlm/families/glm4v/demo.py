"""The GLM variants' demo checkpoints: their sizes, transformers classes, reduced chat template and
random-weight writer (with the multi-token-prediction layer that released GLM-OCR / GLM-4.5V
weights carry)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from triton_vlm.families.demo import Demo, chat_template, random_model
from triton_vlm.families.glm4v.processor import (BEGIN_IMAGE, BEGIN_VIDEO, END_IMAGE, END_VIDEO, ENDOFTEXT, EOS_TOKENS,
                                                 IMAGE_TOKEN, SPECIAL_TOKENS, VIDEO_TOKEN)

GLM_TEMPLATE = chat_template(
    prefix="[gMASK]<sop>", message_start="<|{{ message['role'] }}|>\n", message_end="",
    image=BEGIN_IMAGE + IMAGE_TOKEN + END_IMAGE, video=BEGIN_VIDEO + VIDEO_TOKEN + END_VIDEO,
    generation_prompt="<|assistant|>\n")


# GLM: rotary covers half of each head (`partial_rotary_factor` 0.5), so `mrope_section` sums to
# head_dim / 4. `image_size` sets the learned position-embedding grid that the GLM-4.1V tower
# interpolates to every image's patch grid (GLM-OCR's tower has none).
GLM_SIZES: dict[str, dict[str, Any]] = {
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


# GLM-4.5V: GLM_SIZES with a mixture-of-experts text stack: dense layers before
# `first_k_dense_replace`, then routed experts in `n_group` groups (more experts than
# `num_experts_per_tok`, more than one group, so the group-limited choice is exercised) plus shared ones.
GLM4V_MOE_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {**GLM_SIZES["tiny"], "text": {
        **GLM_SIZES["tiny"]["text"], "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "routed_scaling_factor": 2.5, "norm_topk_prob": True}},
    "small": {**GLM_SIZES["small"], "text": {
        **GLM_SIZES["small"]["text"], "first_k_dense_replace": 1, "n_routed_experts": 16,
        "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 256, "routed_scaling_factor": 2.5, "norm_topk_prob": True}},
}


@dataclass(frozen=True)
class GlmClasses:
    """What one GLM checkpoint is made of: its transformers class names, and whether it carries a
    multi-token-prediction layer after its decoder layers (served checkpoints do; it is not loaded)."""
    config: str
    model: str
    processor: str
    image_processor: str
    video_processor: str
    mtp_layer: bool = False


GLM_CLASSES: dict[str, GlmClasses] = {
    "glm4v": GlmClasses("Glm4vConfig", "Glm4vForConditionalGeneration", "Glm4vProcessor",
                        "Glm4vImageProcessor", "Glm4vVideoProcessor"),
    "glm46v": GlmClasses("Glm46VConfig", "Glm46VForConditionalGeneration", "Glm46VProcessor",
                         "Glm46VImageProcessor", "Glm46VVideoProcessor"),
    "glmga": GlmClasses("GlmgaConfig", "Glm46VForConditionalGeneration", "Glm46VProcessor",
                        "GlmgaImageProcessor", "GlmgaVideoProcessor"),
    "glm_ocr": GlmClasses("GlmOcrConfig", "GlmOcrForConditionalGeneration", "Glm46VProcessor",
                          "Glm46VImageProcessor", "Glm46VVideoProcessor", mtp_layer=True),
    "glm4v_moe": GlmClasses("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration", "Glm4vProcessor",
                            "Glm4vImageProcessor", "Glm4vVideoProcessor", mtp_layer=True),
}


def _write_glm(out: Path, shape: dict[str, Any], tokenizer, seed: int, *, variant: str) -> None:
    """A random-weight GLM checkpoint of `variant` (`GLM_CLASSES`) that transformers loads offline."""
    import torch
    import transformers
    from transformers import GenerationConfig

    names = GLM_CLASSES[variant]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    eos_ids = [ids[t] for t in EOS_TOKENS]
    text = dict(shape["text"])
    mrope_section = text.pop("mrope_section")
    config = getattr(transformers, names.config)(
        text_config=dict(
            vocab_size=shape["model_vocab_size"], max_position_embeddings=4096, rms_norm_eps=1e-5,
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
    model = random_model(getattr(transformers, names.model), config, shape, seed)
    # transformers initialises the routers' score-correction bias to zero, which would leave the
    # biased expert choice untested: a random one, of the sigmoid scores' scale.
    generator = torch.Generator().manual_seed(seed + 1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.rand(buffer.shape, generator=generator) * 0.5)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=ids[ENDOFTEXT],
                                               do_sample=False)
    model.save_pretrained(out)
    if names.mtp_layer:
        _add_mtp_layer(out, config.text_config.num_hidden_layers, seed)

    (img_min, img_max), (vid_min, vid_max) = shape["image_pixels"], shape["video_pixels"]
    image_processor = getattr(transformers, names.image_processor)(
        size={"shortest_edge": img_min, "longest_edge": img_max})
    video_processor = getattr(transformers, names.video_processor)(
        size={"shortest_edge": vid_min, "longest_edge": vid_max})
    processor = getattr(transformers, names.processor)(
        image_processor=image_processor, video_processor=video_processor, tokenizer=tokenizer,
        chat_template=GLM_TEMPLATE)
    processor.save_pretrained(out)


def _add_mtp_layer(out: Path, num_layers: int, seed: int) -> None:
    """Append a multi-token-prediction layer `layers.{num_layers}.*` to the checkpoint (a decoder
    layer's tensors plus the MTP head's `eh_proj`, `enorm`, `hnorm`, `shared_head.norm`, all random),
    as released GLM-OCR / GLM-4.5V weights hold one that transformers and our decoder do not load."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed + 2)
    last, mtp = f"model.language_model.layers.{num_layers - 1}.", f"model.language_model.layers.{num_layers}."
    extra = {mtp + key[len(last):]: torch.randn(value.shape, generator=generator)
             for key, value in tensors.items() if key.startswith(last)}
    hidden = tensors["model.language_model.norm.weight"].shape[0]
    extra[mtp + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        extra[mtp + f"{norm}.weight"] = torch.randn(hidden, generator=generator)
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})


def _glm(variant: str, sizes: dict[str, dict[str, Any]] = GLM_SIZES) -> Demo:
    return Demo(sizes, partial(_write_glm, variant=variant))


DEMOS = {variant: _glm(variant) for variant in ("glm4v", "glm46v", "glmga", "glm_ocr")}
DEMOS["glm4v_moe"] = _glm("glm4v_moe", GLM4V_MOE_SIZES)
