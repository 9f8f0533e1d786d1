"""Canvas M-RoPE (MiniCPM-V 4.7, transformers `MiniCPMV4_7Model.get_rope_index`): 3-D positions of
a prompt whose images are an overview plus slices, each picture laid out on one canvas.

The rule, over one unpadded sequence (`canvas_positions`):

- crops are the maximal runs of image or video tokens; a crop right after `<slice>` is a slice of
  the open frame, any other opens a frame (its overview). Frames that only markers (`<image>`,
  `</image>`, `<slice>`, `</slice>`, newline) separate share a group (a video's frames, or a
  picture sitting against one);
- text counts up by one on all three axes; each frame's canvas starts at the position the text
  reached (`origin`): `<image>` sits on the halo (origin - 1 on h and w), the overview is stretched
  over the whole canvas (`torch.linspace` rounded), slices take their (row, column) place, their
  `<slice>`/`</slice>` pin their corners, `</image>` the canvas's far corner and the newline that
  ends a row of slices sits just past that row's right edge; every other token of the frame gets
  `origin` on all axes. The next frame or text starts at origin + max(canvas h, w) + 1 (the
  reference's extra step for text between two frames of a group is kept, though its grouping
  leaves no such text);
- the decode delta is max(position) + 1 - length, as for every M-RoPE family.

Crop sizes come in prompt order (`grid_thw` rows: the overview of each frame, then its slices),
which is the order the reference reads its image and video `target_sizes` in.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class CanvasMarkers:
    """The marker token ids (`config.json`'s `image_start_id`, ...)."""
    image_start: int
    image_end: int
    slice_start: int
    slice_end: int
    newline: int

    @property
    def all(self) -> tuple[int, ...]:
        return (self.slice_start, self.slice_end, self.image_start, self.image_end, self.newline)


@dataclass
class _Frame:
    thumb_start: int
    thumb_end: int
    slices: list[tuple[int, int]]
    end: int = 0


def _frame_end(index: int, ids: list[int], markers: tuple[int, ...]) -> int:
    """One past the markers that follow `index` (`_frame_end_idx`)."""
    while index < len(ids) and ids[index] in markers:
        index += 1
    return index


def visual_groups(ids: list[int], kinds: np.ndarray, markers: CanvasMarkers) -> list[tuple[int, int, list[_Frame]]]:
    """(group start, group end, frames) of each group, prompt order (`_group_visual_frames`)."""
    if not ids:
        return []
    changes = np.flatnonzero(np.diff(kinds)) + 1
    starts, ends = np.r_[0, changes].tolist(), np.r_[changes, len(ids)].tolist()
    marker_ids = markers.all
    groups: list[tuple[int, list[_Frame]]] = []
    open_frame: _Frame | None = None
    previous_end = 0
    for start, end in zip(starts, ends):
        if kinds[start] == 0:
            continue
        if open_frame is not None and ids[start - 1] == markers.slice_start:
            open_frame.slices.append((start, end))
        else:
            open_frame = _Frame(start, end, [])
            gap = ids[previous_end:start - 1]
            if groups and all(token in marker_ids for token in gap):
                groups[-1][1].append(open_frame)
            else:
                groups.append((start - 1, [open_frame]))
        previous_end = end
    out = []
    for group_start, frames in groups:
        for frame in frames:
            frame.end = _frame_end(frame.slices[-1][1] if frame.slices else frame.thumb_end, ids, marker_ids)
        out.append((group_start, frames[-1].end, frames))
    return out


@lru_cache(maxsize=4096)
def _stretch(canvas: int, n: int) -> np.ndarray:
    """`torch.linspace(0, canvas - 1, n).round()` (float32, as the reference computes it)."""
    import torch

    values = torch.linspace(0, canvas - 1, n).round().long().numpy()
    values.setflags(write=False)  # cached: shared by every caller
    return values


def crop_positions(origin: int, size: tuple[int, int], merge: int, canvas: tuple[int, int] = (0, 0),
                   offset: tuple[int, int] = (0, 0)) -> np.ndarray:
    """int64 [3, h * w] (`get_vision_position_ids`): a crop of `size` patches, `merge` patches a
    token per side, stretched over `canvas` tokens (0: its own size) at `offset`, from `origin`."""
    h, w = size[0] // merge, size[1] // merge
    rows = _stretch(canvas[0] or h, h) + offset[0]
    cols = _stretch(canvas[1] or w, w) + offset[1]
    return np.stack([np.zeros(h * w, np.int64), np.repeat(rows, w), np.tile(cols, h)]) + origin


def _slice_columns(slices: list[tuple[int, int]]) -> tuple[int, int]:
    """(rows, cols) of a frame's slices: a gap wider than `</slice><slice>` ends a row."""
    cols = len(slices)
    for k in range(len(slices) - 1):
        if slices[k + 1][0] - slices[k][1] > 2:
            cols = k + 1
            break
    rows = len(slices) // cols
    return (rows, cols) if rows * cols == len(slices) else (1, len(slices))


def canvas_positions(input_ids: np.ndarray, kinds: np.ndarray, sizes: np.ndarray, markers: CanvasMarkers,
                     merge: int) -> tuple[np.ndarray, int]:
    """Positions int64 [3, S] and the delta of one prompt. `kinds`: 0 text, 1 image, 2 video per
    token (the processor's `mm_token_type_ids`); `sizes` [crops, 2]: each crop's (h, w) in patches,
    prompt order; `merge`: patches per token side (4 for "16x", 2 for "4x")."""
    ids = np.asarray(input_ids).tolist()
    seq_len = len(ids)
    pos = np.tile(np.arange(seq_len, dtype=np.int64), (3, 1))
    crop_sizes = iter(np.asarray(sizes).reshape(-1, 2).tolist())
    current_pos = current_idx = 0
    for group_start, group_end, frames in visual_groups(ids, np.asarray(kinds), markers):
        if group_start > current_idx:
            pos[:, current_idx:group_start] = np.arange(group_start - current_idx) + current_pos
            current_pos += group_start - current_idx
        cursor = group_start
        for frame in frames:
            thumb = next(crop_sizes)
            frame_start = frame.thumb_start - 1
            if frame_start > cursor:  # text between two frames of a group, then one step more
                pos[:, cursor:frame_start] = np.arange(frame_start - cursor) + current_pos
                current_pos += frame_start - cursor + 1
            frame_end = min(frame.end, group_end)
            origin = current_pos
            canvas_h, canvas_w = thumb[0] // merge, thumb[1] // merge
            slice_h = slice_w = 0
            rows, cols = 0, 0
            if frame.slices:
                rows, cols = _slice_columns(frame.slices)
                first = next(crop_sizes)
                slice_h, slice_w = first[0] // merge, first[1] // merge
                canvas_h, canvas_w = rows * slice_h, cols * slice_w
            pos[:, frame_start:frame_end] = origin
            pos[1:, frame_start] = max(origin - 1, 0)
            if frame.thumb_end < frame_end:
                pos[1:, frame.thumb_end] = (origin + canvas_h, origin + canvas_w)
            pos[:, frame.thumb_start:frame.thumb_end] = crop_positions(origin, thumb, merge, (canvas_h, canvas_w))
            for k, (start, end) in enumerate(frame.slices):
                h_off, w_off = (k // cols) * slice_h, (k % cols) * slice_w
                size = first if k == 0 else next(crop_sizes)
                if start - 1 >= frame_start:
                    pos[1:, start - 1] = (origin + h_off, origin + w_off)
                if end < frame_end:
                    pos[1:, end] = (origin + h_off + size[0] // merge - 1, origin + w_off + size[1] // merge - 1)
                pos[:, start:end] = crop_positions(origin, size, merge, offset=(h_off, w_off))
            for k in range(len(frame.slices) - 1):  # the newline ending a row of slices
                gap_start, gap_end = frame.slices[k][1], frame.slices[k + 1][0]
                if gap_end - gap_start > 2:
                    pos[1, gap_start + 1:gap_end - 1] = origin + (k // cols + 1) * slice_h - 1
                    pos[2, gap_start + 1:gap_end - 1] = origin + cols * slice_w
            current_pos = origin + max(canvas_h, canvas_w) + 1
            cursor = frame_end
        if cursor < group_end:
            pos[:, cursor:group_end] = np.arange(group_end - cursor) + current_pos
            current_pos += group_end - cursor
        current_idx = group_end
    if current_idx < seq_len:
        pos[:, current_idx:] = np.arange(seq_len - current_idx) + current_pos
    delta = int(pos.max()) + 1 - seq_len if seq_len else 0
    return pos, delta
