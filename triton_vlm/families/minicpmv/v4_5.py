"""MiniCPM-V 4.5 (`model_type` `minicpmv`, config `version` 4.5; official remote code, which
transformers 5 lacks): a SigLIP-NaViT tower and `Resampler4_5` on a Qwen3 decoder. Its images are
every remote-code version's (`triton_vlm.families.minicpmv.remote_code`); its own are videos.

Videos follow the official README's "chat with video": frames chosen by `choose_frames` (`fps` is
its `choose_fps`, default 3; `mm_options.force_packing` its `force_packing`), each frame unsliced
and without an image id (`video_settings`), up to MAX_NUM_PACKING frames in one group that the
resampler attends over as a whole: a grid row [frames, h, w] per group and the frames' temporal ids
(`pack_frames`, the `temporal_ids` tensor to `vision_encoder`), one `<unk>` run per group.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from triton_vlm.errors import InvalidInput
from triton_vlm.families.base import MediaLayout
from triton_vlm.families.minicpmv.remote_code import IM_END, IM_START, MARKERS, UNK, expand_images
from triton_vlm.media.mrope import MediaSpan
from triton_vlm.media.videos import distinct_indices, video_facts

ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, UNK, IM_START, IM_END, *MARKERS)


def expand_media(media: MediaLayout, token_id: Callable[[str], int],
                 encode: Callable[[list[str]], list[list[int]]]) -> tuple[np.ndarray, list[MediaSpan]]:
    """An image's runs as every version writes them (`expand_images`). A video's marker stands for
    its frames' `(<image>./</image>)` joined by newlines (the official chat's prompt);
    `MiniCPMVProcessor` gives each packed group's first frame its placeholder and drops the other
    frames' with the (stripped) text before them, so the groups' runs are joined by newlines."""
    if not media.video:
        return expand_images(media, token_id, encode)
    newline = encode(["\n"])[0]
    ids: list[int] = []
    for k, grid in enumerate(media.grids):
        group, _ = expand_images(dataclasses.replace(media, grids=[grid], num_frames=1), token_id, encode)
        ids += [*newline] * bool(k) + group.tolist()
    return np.asarray(ids, dtype=np.int32), []


MAX_NUM_FRAMES, MAX_NUM_PACKING, TIME_SCALE = 180, 3, 0.1
# Temporal ids travel as int32 (the official `frame_ts_id.astype(np.int32)`).
MAX_TEMPORAL_ID = 2 ** 31 - 1


def _plan(duration: float, fps: float, choose_fps: float) -> tuple[int, int]:
    """The official `encode_video`'s (frames chosen, frames per group) for a video of `duration`
    seconds at `fps`: `choose_fps` frames a second, at most MAX_NUM_FRAMES groups, longer videos
    packed by up to MAX_NUM_PACKING frames a group."""
    if choose_fps * int(duration) <= MAX_NUM_FRAMES:
        return round(min(choose_fps, round(fps)) * min(MAX_NUM_FRAMES, duration)), 1
    packing = math.ceil(duration * choose_fps / MAX_NUM_FRAMES)
    if packing <= MAX_NUM_PACKING:
        return round(duration * choose_fps), packing
    return round(MAX_NUM_FRAMES * MAX_NUM_PACKING), MAX_NUM_PACKING


def _uniform(num_frames: int, chosen: int) -> np.ndarray:
    """`uniform_sample`: the middle frame of each of `chosen` equal spans."""
    gap = num_frames / chosen
    return np.array([int(i * gap + gap / 2) for i in range(chosen)], dtype=np.int64)


def temporal_ids(indices: np.ndarray, fps: float, duration: float) -> list[int]:
    """Each frame's time (index / fps) mapped to the nearest point of `np.arange(0, duration,
    TIME_SCALE)` (the first of two equally near), in TIME_SCALE units, as the official
    `map_to_nearest_scale(...) / TIME_SCALE` then `astype(np.int32)`; the grid's points are
    `k * TIME_SCALE` as numpy's arange computes them, never materialised (a long video's grid is
    large). InvalidInput for ids beyond int32."""
    times = np.asarray(indices, dtype=np.float64) / fps
    points = max(1, math.ceil(duration / TIME_SCALE))  # len(np.arange(0, duration, TIME_SCALE))
    if float(times.max(initial=0.0)) / TIME_SCALE > MAX_TEMPORAL_ID:
        raise InvalidInput(f"video frames at {float(times.max()):.0f} s exceed the temporal ids' range "
                           f"({MAX_TEMPORAL_ID} x {TIME_SCALE} s)")
    base = np.floor(times / TIME_SCALE).astype(np.int64)
    candidates = np.clip(base[:, None] + np.arange(-1, 3), 0, points - 1)  # increasing: argmin keeps the first
    nearest = candidates[np.arange(len(times)), np.abs(candidates * TIME_SCALE - times[:, None]).argmin(axis=1)]
    return ((nearest * TIME_SCALE) / TIME_SCALE).astype(np.int32).tolist()


def _groups(ids: list[int], packing: int) -> list[list[int]]:
    return [ids[i:i + packing] for i in range(0, len(ids), packing)]


def choose_frames(num_frames: int, fps: float, choose_fps: float = 3, force_packing: int | None = None
                  ) -> tuple[np.ndarray, list[list[int]]]:
    """The official "chat with video" `encode_video` (MiniCPM-V 4.5 README) on a video of
    `num_frames` frames at `fps`: the frame indices and the temporal ids grouped by packing
    (`force_packing` overrides the packing, up to MAX_NUM_PACKING)."""
    duration = num_frames / fps
    chosen, packing = _plan(duration, fps, choose_fps)
    indices = _uniform(num_frames, chosen)
    return indices, _groups(temporal_ids(indices, fps, duration), min(force_packing, MAX_NUM_PACKING)
                            if force_packing else packing)


def sample_frames(metadata, *, fps: float | None = 3.0, num_frames: int | None = None, max_frames: int = 768,
                  **_other_options) -> np.ndarray:
    """`choose_frames`' indices (`fps` is its `choose_fps`), at most `max_frames` of them (spread
    the same way). Where the official would divide by zero (a video under a frame's worth of
    `choose_fps`) one frame is kept, and where it would choose a frame twice (files slower than
    `choose_fps`) once."""
    if num_frames is not None:
        raise InvalidInput("num_frames: MiniCPM-V 4.5 chooses frames by fps (its choose_fps), not by count; "
                           "use fps or max_frames")
    total, file_fps, _ = video_facts(metadata)
    chosen, _ = _plan(total / file_fps, file_fps, fps or 3.0)
    return distinct_indices(_uniform(total, max(1, min(chosen, int(max_frames)))))


def pack_frames(metadata, *, fps: float | None = 3.0, force_packing: int | None = None) -> list[list[int]]:
    """`Family.pack_frames`: the sampled frames' temporal ids in `choose_frames`' groups."""
    total, file_fps, _ = video_facts(metadata)
    duration = total / file_fps
    _, packing = _plan(duration, file_fps, fps or 3.0)
    if force_packing:
        packing = min(int(force_packing), MAX_NUM_PACKING)
    return _groups(temporal_ids(metadata.frames_indices, file_fps, duration), packing)
