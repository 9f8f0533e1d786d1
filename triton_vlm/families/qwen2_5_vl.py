"""Qwen2.5-VL: placeholders, special tokens, video sampling, M-RoPE scale, demo checkpoint shapes."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from triton_vlm.families.base import Family, chat_template, patch_encoder_dims, random_model

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"

# Qwen's chat template, reduced to what the demo needs.
CHAT_TEMPLATE = chat_template(
    prefix="", message_start="<|im_start|>{{ message['role'] }}\n", message_end="<|im_end|>\n",
    image=VISION_START + IMAGE_PAD + VISION_END, video=VISION_START + VIDEO_PAD + VISION_END,
    generation_prompt="<|im_start|>assistant\n")

# Random-weight demo shapes. `tiny` keeps tests to seconds; `small` is tens of millions of
# parameters for the demo and benchmarks. Windows and full-attention blocks are as in the
# real models (window 112 px, full attention every few blocks).
DEMO_SIZES: dict[str, dict[str, Any]] = {
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


def write_demo(out: Path, shape: dict[str, Any], tokenizer, seed: int) -> None:
    """Write a random-weight Qwen2.5-VL checkpoint that transformers loads offline."""
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_5_VL.special_tokens}
    eos_ids = [ids[t] for t in QWEN2_5_VL.eos_tokens]
    text = dict(shape["text"])
    mrope_section = text.pop("mrope_section")
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=shape["model_vocab_size"], max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=mrope_section),
            bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids, pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=False, **text),
        vision_config=dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           tokens_per_second=2, out_hidden_size=text["hidden_size"], in_channels=3,
                           **shape["vision"]),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )
    model = random_model(Qwen2_5_VLForConditionalGeneration, config, shape, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids, pad_token_id=ids["<|endoftext|>"],
        do_sample=False)
    model.save_pretrained(out)

    (img_min, img_max), (vid_min, vid_max) = shape["image_pixels"], shape["video_pixels"]
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=img_min, max_pixels=img_max),
        video_processor=Qwen2VLVideoProcessor(min_pixels=vid_min, max_pixels=vid_max, fps=2.0),
        tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)


def sample_frames(metadata, *, fps: float | None = 2.0, num_frames: int | None = None, min_frames: int = 4,
                  max_frames: int = 768, temporal_patch_size: int = 2):
    """Frame indices kept from a video: transformers' `Qwen2VLVideoProcessor.sample_frames`.

    Differences, where transformers fails: a video shorter than one temporal patch keeps all its
    frames (the patchifier then repeats the last one) instead of dividing by zero, and a
    `num_frames` that rounds to zero asks for one temporal patch. `num_frames` wins over `fps`.
    """
    import torch

    from triton_vlm.errors import InvalidInput

    total = int(metadata.total_num_frames)
    if num_frames is not None:
        wanted = round(num_frames / temporal_patch_size) * temporal_patch_size
        if wanted <= 0:
            wanted = temporal_patch_size
        if wanted > total:
            raise InvalidInput(f"num_frames={num_frames} asks for {wanted} frames but the video has {total}")
    else:
        max_frames = math.floor(min(max_frames, total) / temporal_patch_size) * temporal_patch_size
        wanted = total / metadata.fps * fps
        wanted = min(max(wanted, min_frames), max_frames, total)
        wanted = math.floor(wanted / temporal_patch_size) * temporal_patch_size
    if wanted <= 0:  # fewer frames than one temporal patch: keep them all
        return torch.arange(total).numpy()
    # Same float32 arithmetic as transformers, so the same frames are picked.
    return torch.arange(0, total, total / wanted).int().numpy()


def video_t_factor(config: dict, second_per_grid_ts: float) -> float:
    """Temporal M-RoPE scale of a video: second_per_grid_ts * vision_config.tokens_per_second."""
    tokens_per_second = (config.get("vision_config") or {}).get("tokens_per_second", 1.0)
    return second_per_grid_ts * tokens_per_second


QWEN2_5_VL = Family(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    image_placeholder=VISION_START + IMAGE_PAD + VISION_END,
    video_placeholder=VISION_START + VIDEO_PAD + VISION_END,
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD),
    named_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD,
                          "vision_start_token": VISION_START, "vision_end_token": VISION_END},
    encoder_dims=patch_encoder_dims,
    demo_sizes=DEMO_SIZES,
    write_demo=write_demo,
    chat_template=CHAT_TEMPLATE,
    sample_frames=sample_frames,
    default_video_fps=2.0,
    video_t_factor=video_t_factor,
    eos_tokens=("<|im_end|>", "<|endoftext|>"),
)
