"""MiniCPM-V 4.7 (transformers `minicpmv4_7`): MiniCPM-V 4.6's tower, slicing and Qwen3.5 decoder,
with canvas M-RoPE (`triton_vlm.families.minicpmv.canvas_mrope`).

What differs from 4.6 (`v4_6`):

- `preprocess` gives the canvas positions `MiniCPMV4_7Model.get_rope_index` computes, and their
  decode delta, instead of plain 0..S-1; the marker ids come from the checkpoint's `config.json`
  (`image_start_id`, `image_end_id`, `slice_start_id`, `slice_end_id`, `newline_id`);
- `MiniCPMV4_7Processor` numbers images only: a video's frames carry no `<image_id>N</image_id>`.

Slices, `pixel_values`, `grid_thw` and the embeddings are 4.6's (both `downsample_mode`s).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from triton_vlm.families.base import MediaLayout
from triton_vlm.families.minicpmv.canvas_mrope import CanvasMarkers, canvas_positions
from triton_vlm.families.minicpmv.slicing import slice_runs
from triton_vlm.media.mrope import MediaSpan

MARKER_KEYS = ("image_start_id", "image_end_id", "slice_start_id", "slice_end_id", "newline_id")


def expand_media(media: MediaLayout, token_id: Callable[[str], int],
                 encode: Callable[[list[str]], list[list[int]]]) -> tuple[np.ndarray, list[MediaSpan]]:
    """4.6's runs (`slice_runs`), a video's without `<image_id>` (`_prepend_local_ids`)."""
    if media.video:
        media = dataclasses.replace(media, settings=dataclasses.replace(media.settings, use_image_id=False))
    return slice_runs(media, media.token, token_id, encode)


def markers(config: dict) -> CanvasMarkers:
    """The canvas markers of a `config.json`; a checkpoint without them cannot place media."""
    missing = [key for key in MARKER_KEYS if config.get(key) is None]
    if missing:
        raise ValueError(f"config.json: canvas M-RoPE needs {', '.join(missing)}")
    return CanvasMarkers(*(int(config[key]) for key in MARKER_KEYS))


def prompt_positions(input_ids: np.ndarray, kinds: np.ndarray, grid_thw: np.ndarray,
                     config: dict) -> tuple[np.ndarray, int]:
    """`Family.prompt_positions`: canvas M-RoPE with the model's `downsample_mode` (the divisor
    `get_rope_index` uses: 4 patches a token per side in "16x", 2 in "4x")."""
    if not kinds.any():
        seq_len = int(np.asarray(input_ids).shape[0])
        return np.tile(np.arange(seq_len, dtype=np.int64), (3, 1)), 0
    merge = 2 if config.get("downsample_mode", "16x") == "4x" else 4
    return canvas_positions(input_ids, kinds, np.asarray(grid_thw)[:, 1:], markers(config), merge)


