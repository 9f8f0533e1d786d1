"""Qwen3-VL's processor rules (Qwen3.5 shares them): Qwen2-VL's image processor with 16-pixel
patches, `Qwen3VLVideoProcessor`'s frame sampling (`np.linspace` over the video, an odd count
padded with the last frame by the patchifier) and sizing (one pixel budget over all frames), and
`Qwen3VLProcessor`'s video prompt: every temporal patch its own `<|vision_start|>` ... `<|vision_end|>`
span after its timestamp text (`<1.3 seconds>`)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from triton_vlm.errors import InvalidInput
from triton_vlm.families.base import MediaLayout, expand_plain
from triton_vlm.media.mrope import MediaSpan
from triton_vlm.media.sizing import qwen2_vl_resize, smart_resize
from triton_vlm.media.videos import video_facts

from triton_vlm.families.qwen2_5_vl.processor import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START

# `Qwen3VLVideoProcessor`'s class defaults (`size.shortest_edge`, `size.longest_edge`; 16-pixel
# patches), for processor configs that leave them out.
VIDEO_SIZE_DEFAULT = (128 * 32 * 32, 32 * 32 * 768)
VIDEO_DEFAULTS = {"patch_size": 16, "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5)}
MAX_VIDEO_TOKENS = 768


def sample_frames(metadata, *, fps: float | None = 2.0, num_frames: int | None = None, min_frames: int = 4,
                  max_frames: int = 768, temporal_patch_size: int = 2, **_other_options) -> np.ndarray:
    """`Qwen3VLVideoProcessor.sample_frames`: n = min(max(int(total / video_fps * fps), min_frames),
    max_frames, total) frames (or `num_frames`), at `np.linspace(0, total - 1, n).round()` (numpy
    rounds half to even, as transformers). Refused where transformers would repeat frames (more
    `num_frames` than the video has) or fail (fewer frames than one temporal patch)."""
    total, video_fps, _ = video_facts(metadata)
    if num_frames is None:
        n = min(max(int(total / video_fps * fps), min_frames), max_frames, total)
    else:
        n = int(num_frames)
        if n > total:
            raise InvalidInput(f"num_frames={n} asks for more frames than the video's {total}")
    if n < temporal_patch_size:
        raise InvalidInput(f"video has {n} frame(s) to sample; Qwen3-VL's video processor needs at least "
                           f"{temporal_patch_size}")
    return np.linspace(0, total - 1, n).round().astype(np.int64)


def resize_rule(height: int, width: int, settings, num_frames: int, name: str) -> tuple[int, int]:
    """An image (`num_frames` 1): Qwen2-VL's `smart_resize`. A video's frames:
    `video_processing_qwen3_vl.smart_resize`, whose pixel budget covers the sampled frames (their
    count, before the odd one is padded), frames smaller than one `factor` scaled up first."""
    if num_frames == 1:
        return qwen2_vl_resize(height, width, settings, num_frames, name)
    factor = settings.factor
    if height <= 0 or width <= 0:
        raise InvalidInput(f"{name}: image has no pixels")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    return smart_resize(height, width, factor, settings.min_pixels, settings.max_pixels, name, num_frames,
                        settings.temporal_patch_size)


def video_cap(settings, max_video_tokens: int, num_frames: int):
    """`Qwen3VLVideoProcessor.resize` with `cap_pixels_per_frame`: each frame's pixels at most
    `max_video_tokens * factor^2` and `longest_edge // frames`, at least 1.05 `shortest_edge`; the
    video's budget is that times its frames."""
    per_frame = max(min(max_video_tokens * settings.factor ** 2, settings.max_pixels // num_frames),
                    int(settings.min_pixels * 1.05))
    return dataclasses.replace(settings, max_pixels=per_frame * num_frames)


def frame_timestamps(seconds: np.ndarray, pairs: int, temporal_patch_size: int) -> list[float]:
    """`Qwen3VLProcessor._calculate_timestamps`: the sampled frames' times padded with the last to a
    whole number of temporal patches, then each patch's mean of its first and last frame."""
    times = [float(s) for s in seconds]
    times += times[-1:] * (-len(times) % temporal_patch_size)
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(times), temporal_patch_size)][:pairs]


def expand_media(media: MediaLayout, token_id: Callable[[str], int],
                 encode: Callable[[list[str]], list[list[int]]]) -> tuple[np.ndarray, list[MediaSpan]]:
    """An image: `expand_plain`. A video's `<|video_pad|>` (`Qwen3VLProcessor.replace_video_token`):
    per temporal patch `<{seconds:.1f} seconds>`, `<|vision_start|>`, h * w `<|video_pad|>` and
    `<|vision_end|>`; each patch is its own M-RoPE span (t = 1), as `get_rope_index` splits videos."""
    if not media.video:
        return expand_plain(media, token_id, encode)
    t, h, w = media.merged_grid
    stamps = frame_timestamps(media.timestamps, t, media.settings.temporal_patch_size)
    texts = encode([f"<{s:.1f} seconds>" for s in stamps])
    start, end = token_id(VISION_START), token_id(VISION_END)
    pieces, spans, offset = [], [], 0
    for text in texts:
        pieces += [np.array([*text, start], np.int32), np.full(h * w, media.token, np.int32), np.array([end], np.int32)]
        spans.append(MediaSpan(offset + len(text) + 1, 1, h, w))
        offset += len(text) + h * w + 2
    return np.concatenate(pieces), spans
