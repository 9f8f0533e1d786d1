"""Qwen2.5-VL's and Qwen2-VL's demo checkpoints: their sizes, reduced chat template and
random-weight writer."""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable

from triton_vlm.families.demo import Demo, chat_template, random_model
from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL, QWEN2_VL
from triton_vlm.families.qwen2_5_vl.processor import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START

# Qwen2.5-VL's chat template, reduced to what the demo needs.
QWEN_TEMPLATE = chat_template(
    prefix="", message_start="<|im_start|>{{ message['role'] }}\n", message_end="<|im_end|>\n",
    image=VISION_START + IMAGE_PAD + VISION_END, video=VISION_START + VIDEO_PAD + VISION_END,
    generation_prompt="<|im_start|>assistant\n")


# Random-weight demo shapes. `tiny` keeps tests to seconds; `small` is tens of millions of
# parameters for the demo and benchmarks.
# Qwen2.5-VL: windows and full-attention blocks as in the real models (window 112 px, full
# attention every few blocks).
QWEN2_5_VL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, mrope_section=[2, 3, 3]),
        vision=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[1, 3]),
        image_pixels=(4 * 28 * 28, 256 * 28 * 28), video_pixels=(4 * 28 * 28, 64 * 28 * 28),
    ),
    "small": dict(
        vocab_size=8192,
        text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, mrope_section=[8, 12, 12]),
        vision=dict(depth=8, hidden_size=256, intermediate_size=704, num_heads=4, fullatt_block_indexes=[3, 7]),
        image_pixels=(16 * 28 * 28, 1024 * 28 * 28), video_pixels=(16 * 28 * 28, 256 * 28 * 28),
    ),
}


# Qwen2-VL: the tower as `Qwen2VLVisionConfig` sizes it (`embed_dim` wide, MLPs `mlp_ratio` times
# that; `hidden_size`, the merger's output, is the text model's, set by the writer).
QWEN2_VL_SIZES: dict[str, dict[str, Any]] = {
    size: {**shape, "vision": vision} for (size, shape), vision in zip(QWEN2_5_VL_SIZES.items(), (
        dict(depth=4, embed_dim=32, mlp_ratio=2, num_heads=2),
        dict(depth=8, embed_dim=256, mlp_ratio=4, num_heads=4)))}


def _write(out: Path, shape: dict[str, Any], tokenizer, seed: int, family, classes: str,
           vision: Callable[[int], dict[str, Any]], video_fps: dict[str, Any]) -> None:
    """Write a random-weight checkpoint of `family` that transformers loads offline: `classes`, the
    prefix of its transformers config, model and processor classes; `vision(text hidden size)`, the
    vision config's keys beside the shape's; `video_fps`, the video processor's sampling keys."""
    import transformers
    from transformers import GenerationConfig, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in family.prompt.special_tokens}
    eos_ids = [ids[t] for t in family.prompt.eos_tokens]
    text = dict(shape["text"])
    mrope_section = text.pop("mrope_section")
    config = getattr(transformers, classes + "Config")(
        text_config=dict(
            vocab_size=shape["model_vocab_size"], max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=mrope_section),
            bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids, pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=False, **text),
        vision_config=dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           **vision(text["hidden_size"]), **shape["vision"]),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )
    model = random_model(getattr(transformers, classes + "ForConditionalGeneration"), config, shape, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids, pad_token_id=ids["<|endoftext|>"],
        do_sample=False)
    model.save_pretrained(out)

    (img_min, img_max), (vid_min, vid_max) = shape["image_pixels"], shape["video_pixels"]
    processor = getattr(transformers, classes + "Processor")(
        image_processor=Qwen2VLImageProcessor(min_pixels=img_min, max_pixels=img_max),
        video_processor=Qwen2VLVideoProcessor(min_pixels=vid_min, max_pixels=vid_max, **video_fps),
        tokenizer=tokenizer, chat_template=QWEN_TEMPLATE)
    processor.save_pretrained(out)


# Qwen2.5-VL's windows and time scale; Qwen2-VL's merger output (its video processor keeps its
# class's default: no rate, every frame).
DEMOS = {
    "qwen2_5_vl": Demo(QWEN2_5_VL_SIZES, partial(
        _write, family=QWEN2_5_VL, classes="Qwen2_5_VL", video_fps=dict(fps=2.0),
        vision=lambda text_hidden: dict(window_size=112, tokens_per_second=2, out_hidden_size=text_hidden))),
    "qwen2_vl": Demo(QWEN2_VL_SIZES, partial(
        _write, family=QWEN2_VL, classes="Qwen2VL", video_fps={}, vision=lambda text_hidden: dict(hidden_size=text_hidden))),
}
