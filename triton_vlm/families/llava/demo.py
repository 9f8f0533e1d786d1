"""The LLaVA and LLaVA-OneVision demo checkpoints: their sizes (tower kinds, feature layers and
strategies, pinpoints), reduced chat templates and random-weight writers."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from triton_vlm.families.demo import Demo, chat_template, perturb, random_model
from triton_vlm.families.llava import LLAVA, LLAVA_ONEVISION
from triton_vlm.families.llava import onevision as ov
from triton_vlm.families.llava import processor as llava

LLAVA_TEMPLATE = chat_template(
    prefix="", message_start="{{ message['role'] | upper }}: ", message_end="\n", image=llava.IMAGE_TOKEN + "\n",
    video=llava.VIDEO_TOKEN + "\n", generation_prompt="ASSISTANT:")


# LLaVA-OneVision's (Qwen2's im_start / im_end turns, media before the text).
LLAVA_ONEVISION_TEMPLATE = chat_template(
    prefix="", message_start="<|im_start|>{{ message['role'] }}\n", message_end="<|im_end|>\n",
    image=ov.IMAGE_TOKEN + "\n", video=ov.VIDEO_TOKEN + "\n", generation_prompt="<|im_start|>assistant\n")


# LLaVA: the tower (`vision_model`: clip_vision_model or siglip_vision_model) sees image_size
# squares (CLIPImageProcessor: shortest edge, then the centre crop, both image_size); `small` has
# LLaVA-1.5's 24 x 24 patches. `text_model` (llama, qwen2), `vision_feature_layer` and
# `vision_feature_select_strategy` are the variants the tests cover, and `image_processor` ("clip",
# the default: shortest edge and centre crop; "siglip": resized to the square, no crop).
LLAVA_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024, text_model="llama", vision_model="clip_vision_model",
        vision_feature_layer=-2, vision_feature_select_strategy="default",
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                    image_size=112, patch_size=14),
    ),
    "small": dict(
        vocab_size=8192, text_model="llama", vision_model="clip_vision_model",
        vision_feature_layer=-2, vision_feature_select_strategy="default",
        text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2),
        vision=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4,
                    image_size=336, patch_size=14),
    ),
}


# LLaVA-OneVision: tiles of `image_size` pixels (S = image_size / patch_size features a side, odd
# here so that the video pooling rounds up), pinpoints up to 3 x 3 tiles, and "anyres_max_4" in the
# tiny shape so that large images take the bilinear cut.
def grid_pinpoints(tile: int, most: int) -> list[list[int]]:
    return [[tile * r, tile * c] for r in range(1, most + 1) for c in range(1, most + 1)]


LLAVA_ONEVISION_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024, vision_aspect_ratio="anyres_max_4", pinpoints=grid_pinpoints(70, 3),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                    image_size=70, patch_size=14),
    ),
    "small": dict(
        vocab_size=8192, vision_aspect_ratio="anyres_max_9", pinpoints=grid_pinpoints(384, 6),
        text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2),
        vision=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4,
                    image_size=384, patch_size=14),
    ),
}


def _write_llava(out: Path, shape: dict[str, Any], tokenizer, seed: int) -> None:
    """Write a random-weight LLaVA checkpoint (`LlavaForConditionalGeneration`, `LlavaProcessor`
    with a `CLIPImageProcessor`) that transformers loads offline."""
    from transformers import (CLIPImageProcessor, GenerationConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor, SiglipImageProcessor)

    from triton_vlm.families.llava.tower import TOWER_KINDS

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LLAVA.prompt.special_tokens}
    vision = dict(model_type=shape["vision_model"], **shape["vision"])
    config = LlavaConfig(
        text_config=dict(
            model_type=shape["text_model"], vocab_size=shape["model_vocab_size"], max_position_embeddings=4096,
            rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            bos_token_id=ids[llava.BOS], eos_token_id=ids[llava.EOS], pad_token_id=ids[llava.PAD],
            tie_word_embeddings=False, **shape["text"]),
        vision_config=vision, image_token_id=ids[llava.IMAGE_TOKEN],
        vision_feature_layer=shape["vision_feature_layer"],
        vision_feature_select_strategy=shape["vision_feature_select_strategy"], tie_word_embeddings=False,
    )
    model = random_model(LlavaForConditionalGeneration, config, shape, seed)
    model.generation_config = GenerationConfig(bos_token_id=ids[llava.BOS], eos_token_id=ids[llava.EOS],
                                               pad_token_id=ids[llava.PAD], do_sample=False)
    model.save_pretrained(out)

    side = vision["image_size"]
    image_processors = {  # LLaVA-1.5's; llava-interleave's (SigLIP tower)
        "clip": lambda: CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}),
        "siglip": lambda: SiglipImageProcessor(size={"height": side, "width": side})}
    processor = LlavaProcessor(
        image_processor=image_processors[shape.get("image_processor", "clip")](), tokenizer=tokenizer, patch_size=vision["patch_size"],
        vision_feature_select_strategy=shape["vision_feature_select_strategy"],
        num_additional_image_tokens=int(TOWER_KINDS[shape["vision_model"]].class_token), chat_template=LLAVA_TEMPLATE)
    processor.save_pretrained(out)


def _write_llava_onevision(out: Path, shape: dict[str, Any], tokenizer, seed: int) -> None:
    """Write a random-weight LLaVA-OneVision checkpoint (`LlavaOnevisionForConditionalGeneration`,
    `LlavaOnevisionProcessor` with its image and video processors) that transformers loads offline:
    SigLIP tower, the last layer's features ("full"), Qwen2 decoder."""
    from transformers import (GenerationConfig, LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                              LlavaOnevisionImageProcessor, LlavaOnevisionProcessor,
                              LlavaOnevisionVideoProcessor)

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LLAVA_ONEVISION.prompt.special_tokens}
    vision = dict(model_type="siglip_vision_model", **shape["vision"])
    config = LlavaOnevisionConfig(
        text_config=dict(
            model_type="qwen2", vocab_size=shape["model_vocab_size"], max_position_embeddings=4096,
            rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            bos_token_id=ids[ov.IM_START], eos_token_id=ids[ov.EOS], pad_token_id=ids[ov.PAD],
            tie_word_embeddings=False, **shape["text"]),
        vision_config=vision, image_token_id=ids[ov.IMAGE_TOKEN], video_token_id=ids[ov.VIDEO_TOKEN],
        vision_feature_layer=-1, vision_feature_select_strategy="full", image_grid_pinpoints=shape["pinpoints"],
        vision_aspect_ratio=shape["vision_aspect_ratio"], tie_word_embeddings=False,
    )
    model = random_model(LlavaOnevisionForConditionalGeneration, config, shape, seed)
    # SigLIP's biases start at zero and its norms at one: move them
    perturb(model, seed, lambda name, p: 0.1 if p.ndim == 1 and ("vision_tower" in name
                                                                 or "multi_modal_projector" in name) else 0)
    model.generation_config = GenerationConfig(eos_token_id=ids[ov.EOS], pad_token_id=ids[ov.PAD], do_sample=False)
    model.save_pretrained(out)

    side, patch = vision["image_size"], vision["patch_size"]
    size = {"height": side, "width": side}
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=shape["pinpoints"]),
        video_processor=LlavaOnevisionVideoProcessor(size=size), tokenizer=tokenizer,
        num_image_tokens=(side // patch) ** 2, vision_feature_select_strategy="full",
        vision_aspect_ratio=shape["vision_aspect_ratio"], chat_template=LLAVA_ONEVISION_TEMPLATE)
    processor.save_pretrained(out)


DEMOS = {"llava": Demo(LLAVA_SIZES, _write_llava),
         "llava_onevision": Demo(LLAVA_ONEVISION_SIZES, _write_llava_onevision)}
