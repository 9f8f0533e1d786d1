"""Per-request resource limits of the `preprocess` step.

A request that breaches one fails alone with `InvalidInput`, whose message names the input and
the limit (`videos[0]: 9000 frames exceed max_frames=768`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    # Encoded size of one media item after base64 / data: URL decoding.
    max_item_bytes: int = 64 * 1024 * 1024
    # Pixels of one decoded image or video frame, checked from the header before decoding.
    max_image_pixels: int = 8192 * 8192
    # Frames sampled (decoded and kept) from one video: HF Qwen2-VL's own max_frames.
    max_video_frames: int = 768
    # Frames in one video file (the decoder walks through them): one hour at 30 fps.
    max_video_source_frames: int = 108_000
    # Images plus videos in one request.
    max_media_items: int = 16
    # max(h, w) / min(h, w) of an image or frame (the vision tower's own bound).
    max_aspect_ratio: float = 200.0


DEFAULT_LIMITS = Limits()
