"""Per-request resource limits of the `preprocess` step: the one place they are set.

A request that breaches one fails alone with `InvalidInput` (Triton INVALID_ARG), whose message
names the input and the limit (`videos[0]: 9000 frames exceed max_frames=768`). Every field is a
build option (`triton-vlm build --max-item-bytes N ...`, `BuildOptions.limits`), written into the
`preprocess` model's config parameters and read back by `PreprocessModel.initialize`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from triton_vlm.contract.params import ModelParams


@dataclass(frozen=True)
class Limits(ModelParams):
    # Encoded size of one media item after base64 / data: URL decoding.
    max_item_bytes: int = 64 * 1024 * 1024
    # Encoded size of all media items of one request together.
    max_request_bytes: int = 256 * 1024 * 1024
    # Pixels of one decoded image or video frame, checked from the header before decoding
    # (decompression bombs).
    max_image_pixels: int = 8192 * 8192
    # Frames sampled (decoded and kept) from one video: HF Qwen2-VL video processor's own max_frames.
    max_video_frames: int = 768
    # Frames in one video file (the decoder walks through them): one hour at 30 fps.
    max_video_source_frames: int = 108_000
    # Images plus videos in one request.
    max_media_items: int = 16
    # max(h, w) / min(h, w) of an image or frame (the vision tower's own bound).
    max_aspect_ratio: float = 200.0
    # Prompt tokens after every placeholder is expanded to its media item's tokens (128k: the largest served context;
    # the llm step checks the checkpoint's own context as well).
    max_prompt_tokens: int = 131072
    # Patches of one image or video frame: the vision encoder's largest run (the build lowers it to
    # the encoder's `encoder_max_batch_patches` and, for TensorRT, its profile's `trt_max_patches`).
    max_frame_patches: int = 65536

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> Limits:
        """Limits from model config parameters (`ModelParams.from_params`), each one positive."""
        limits = super().from_params(params)
        for f in dataclasses.fields(cls):
            if f.name in params and not getattr(limits, f.name) > 0:
                raise ValueError(f"{f.name} must be positive, got {params[f.name]!r}")
        return limits


DEFAULT_LIMITS = Limits()
