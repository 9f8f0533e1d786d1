"""Qwen2-VL's and Qwen2.5-VL's processor rules: their placeholder tokens, video frame sampling
(`Qwen2VLVideoProcessor`'s) and Qwen2.5-VL's temporal M-RoPE scale of a video."""
from __future__ import annotations

import math

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"

def sample_frames(metadata, *, fps: float | None = 2.0, num_frames: int | None = None, min_frames: int = 4,
                  max_frames: int = 768, temporal_patch_size: int = 2):
    """Frame indices kept from a video: transformers' `Qwen2VLVideoProcessor.sample_frames`.

    Differences, where transformers fails: a video shorter than one temporal patch keeps all its
    frames (the patchifier then repeats the last one) instead of dividing by zero, and a
    `num_frames` that rounds to zero asks for one temporal patch, and given neither `fps` nor
    `num_frames` (Qwen2-VL's processor has no rate of its own) every frame is kept. `num_frames`
    wins over `fps`.
    """
    import torch

    from triton_vlm.errors import InvalidInput

    total = int(metadata.total_num_frames)
    if num_frames is None and fps is None:
        return torch.arange(total).numpy()
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
    """Temporal M-RoPE scale of a video: second_per_grid_ts * vision_config.tokens_per_second (4
    where the config leaves it out, as `Qwen2_5_VLVisionConfig`)."""
    tokens_per_second = (config.get("vision_config") or {}).get("tokens_per_second", 4)
    return second_per_grid_ts * tokens_per_second


