"""A request's media items on their way through `Preprocessor`: each `Item` as the prompt names it,
then planned (phase 1: settings, views, grid rows, from headers where they tell), then decoded and
written into its rows of `pixel_values` (`fill`, phase 2, video frames a temporal patch at a time
as their GOPs finish decoding); items run in parallel threads (`map_items`).
"""
from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from triton_vlm.contract.limits import Limits
from triton_vlm.errors import InvalidInput
from triton_vlm.families.base import ProcessorRules
from triton_vlm.media.frames import FrameLayout
from triton_vlm.media.images import decode_image, not_decodable_image
from triton_vlm.media.sizing import VisionSettings
from triton_vlm.media.videos import DemuxedVideo, PlannedVideo, frame_rgb
from triton_vlm.preprocessing.request import VideoSampling


@dataclass(frozen=True)
class Item:
    """One media item of a request: as the prompt names it (`Preprocessor._items`: name, bytes, index, kind),
    then planned (`Preprocessor._plan`, phase 1 of `Preprocessor.__call__`: a new item with its settings, views
    and grid rows, and what phase 2, `fill`, still has to decode)."""
    name: str
    data: bytes
    index: int = 0                      # among the request's items of its kind
    video: bool = False
    settings: VisionSettings | None = None
    layout: FrameLayout | None = None
    num_frames: int = 1
    grids: list[tuple[int, int, int]] = field(default_factory=list)  # its grid_thw rows
    t_factor: float = 1.0
    timestamps: np.ndarray | None = None  # a video's sampled frames, in seconds
    frames: np.ndarray | None = None    # resized uint8 frames, when phase 1 had to decode
    video_file: DemuxedVideo | None = None  # a video, demuxed once
    planned: PlannedVideo | None = None  # an H.264 video whose frames phase 2 decodes
    probed: tuple[int, int] | None = None
    temporal_ids: list[list[int]] | None = None  # a packed video's, per group (`ProcessorRules.pack_frames`)


def item_extras(item: Item, rules: ProcessorRules, largest_frame: int) -> dict[str, np.ndarray]:
    """The contract's extras an item says something in (`contract.tensors.EXTRAS`): a packed
    video's temporal ids, one per frame of its grid rows (`ProcessorRules.pack_frames`); an image's
    own size, one per grid row, where the tower unpads by it (`ProcessorRules.image_sizes`); the
    request's `largest_frame` (patches), one per grid row, where the tower pads every frame to it
    (`ProcessorRules.padded_patches`)."""
    extras = {}
    if item.temporal_ids is not None:
        extras["temporal_ids"] = np.array([i for group in item.temporal_ids for i in group], dtype=np.int64)
    if rules.image_sizes and item.probed:
        extras["image_sizes"] = np.array([item.probed] * len(item.grids), dtype=np.int64).reshape(-1, 2)
    if rules.padded_patches:
        extras["padded_patches"] = np.full(len(item.grids), largest_frame, dtype=np.int64)
    return extras


def fill(item: Item, out: np.ndarray, limits: Limits) -> None:
    """Phase 2: decode what is left of `item` and write its pixel rows into `out`."""
    settings, layout, frames = item.settings, item.layout, item.frames
    if frames is None and item.planned is None:  # an image known from its header
        decoded = decode_image(item.data, item.name, limits)[None]
        if tuple(decoded.shape[1:3]) != item.probed:
            raise not_decodable_image(item.name, item.data,
                                      f"decoded to {decoded.shape[1:3]}, header said {item.probed}")
        frames = layout.resize(decoded, settings)
    if frames is not None:
        layout.write(frames, settings, out)
        return
    meta, tps = item.planned.meta, settings.temporal_patch_size
    n = len(meta.frames_indices)
    staging = np.empty((n, *layout.stored, 3), dtype=np.uint8)
    n_patches = -(-n // tps)
    rows_per_patch = out.shape[0] // n_patches
    pending = [min(tps, n - g * tps) for g in range(n_patches)]  # frames missing per temporal patch
    lock = threading.Lock()

    def store(k: int, frame) -> None:
        staging[k] = layout.resize(frame_rgb(frame, meta.width, meta.height)[None], settings)[0]
        g = k // tps
        with lock:
            pending[g] -= 1
            ready = pending[g] == 0
        if ready:
            layout.write(staging[g * tps:min(n, (g + 1) * tps)], settings,
                         out[g * rows_per_patch:(g + 1) * rows_per_patch])

    if not item.planned.decode(store):
        # The fast path could not vouch for its frames: decode everything (from the packets
        # already demuxed), which must agree.
        frames, _ = item.video_file.decode(lambda _meta: meta.frames_indices,
                                           lambda _m: (layout.stored, lambda f: layout.resize(f, settings)))
        if frames.shape[0] != n:
            raise InvalidInput(f"{item.name}: not a decodable video")
        layout.write(frames, settings, out)


def map_items(fn, args) -> list:
    """`[fn(a) for a in args]`, in threads when there are several (the work releases the GIL).
    The first failure (an `InvalidInput` naming its item, in prompt order) is raised."""
    args = list(args)
    workers = min(len(args), os.cpu_count() or 1)
    if workers <= 1:
        return [fn(a) for a in args]
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(fn, a) for a in args]
        return [f.result() for f in futures]


def bind_sampler(sample_frames, sampling: VideoSampling, settings: VisionSettings):
    """The family's frame sampler with this request's options."""
    if sample_frames is None:
        return lambda meta: np.arange(meta.total_num_frames)
    return partial(sample_frames, fps=sampling.fps, num_frames=sampling.num_frames,
                   min_frames=sampling.min_frames, max_frames=sampling.max_frames,
                   temporal_patch_size=settings.temporal_patch_size, **dict(sampling.extra))


def frame_settings(settings: VisionSettings, sampling: VideoSampling, num_frames: int,
                   cap=None) -> VisionSettings:
    """The video settings for `num_frames` frames: with transformers' `cap_pixels_per_frame`, the
    family's `cap` (`ProcessorRules.video_cap`), else Qwen2-VL's: each frame gets an even share of
    the video's pixel budget."""
    if not sampling.cap_pixels_per_frame:
        return settings
    if cap is not None:
        return cap(settings, sampling.max_video_tokens, num_frames)
    factor = settings.factor
    total_pixels = int(sampling.max_video_tokens * factor * factor * 0.9)
    max_pixels = max(min(settings.max_pixels, total_pixels * settings.temporal_patch_size // num_frames),
                     int(settings.min_pixels * 1.05))
    return dataclasses.replace(settings, max_pixels=max_pixels)
