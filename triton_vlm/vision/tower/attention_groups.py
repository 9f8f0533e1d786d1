"""Host-side metadata of the vision towers (numpy): attention groups, 2-D rotary tables, grids.

Attention runs in groups (every frame, as `cu_seqlens`, and in a window-attention tower also every window).
The host computes, with numpy, for each kind of group:

- ``*_index``   int64 [G, L]: patch indices of each group, padded at the end with a real index of
  the same group (never a negative pad value);
- ``*_mask``    float32 [G, L]: additive key mask, 0 for real keys and a large negative (finite)
  value for padding;
- ``*_inverse`` int64 [N]: for each patch, its position in the flattened [G * L] layout.

plus the rotary ``cos`` / ``sin`` per patch [N, head_dim]. Each block gathers q/k/v into
[G, L, dim], attends, and gathers the result back with the inverse index. Padded query rows are
computed and dropped by the inverse gather. No dense N x N mask is ever built. In float32 ONNX
exports the attention is one `com.microsoft::MultiHeadAttention` node (key padding mask = valid
keys per group, derived in the graph from the additive mask); `export.mask_only_when_padded` lets
it drop the mask when no group is padded, and `export.unfuse_attention` turns it back into standard
ops for TensorRT.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import numpy as np

MASK_VALUE = -1.0e9  # large negative, finite: every group holds at least one real key
FULL_INPUTS = ("full_index", "full_mask", "full_inverse")
ROTARY_INPUTS = ("rotary_cos", "rotary_sin")


def groups(order: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group layout for patches `order` (concatenated groups of lengths `sizes`, all > 0).

    Returns gather index [G, L] (padded with the group's last real index), additive key mask
    [G, L] and the inverse index [N] into the flattened [G * L] layout."""
    sizes = sizes.astype(np.int64)
    n_groups = len(sizes)
    length = int(sizes.max())
    starts = np.zeros(n_groups, dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    slot = np.arange(length, dtype=np.int64)
    valid = slot[None, :] < sizes[:, None]
    pos = np.minimum(starts[:, None] + slot[None, :], (starts + sizes - 1)[:, None])
    index = order[pos]
    mask = np.where(valid, np.float32(0.0), np.float32(MASK_VALUE)).astype(np.float32)
    group_of = np.repeat(np.arange(n_groups, dtype=np.int64), sizes)
    flat = group_of * length + (np.arange(len(order), dtype=np.int64) - starts[group_of])
    inverse = np.empty(len(order), dtype=np.int64)
    inverse[order] = flat
    return index, mask, inverse


def frame_groups(grid: np.ndarray) -> dict[str, np.ndarray]:
    """`full_*` metadata: one attention group per frame (`cu_seqlens`)."""
    sizes = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
    index, mask, inverse = groups(np.arange(int(sizes.sum()), dtype=np.int64), sizes)
    return dict(full_index=index, full_mask=mask, full_inverse=inverse)


Layout = TypeVar("Layout")


def item_layouts(grid: np.ndarray, layout: Callable[[int, int], Layout]
                 ) -> list[tuple[int, int, int, int, Layout]]:
    """Per item of `grid`: (t, h, w, its first patch row, `layout(h, w)`). A tower's per-frame
    metadata depends only on the frame's size, so each size is laid out once and every frame of
    every item of that size reuses it."""
    per_size: dict[tuple[int, int], Layout] = {}
    items, offset = [], 0
    for t, h, w in grid.tolist():
        if (h, w) not in per_size:
            per_size[(h, w)] = layout(h, w)
        items.append((t, h, w, offset, per_size[(h, w)]))
        offset += t * h * w
    return items


def per_frame_tables(grid: np.ndarray, layout: Callable[[int, int], Layout]) -> tuple[np.ndarray, ...]:
    """The tables of `layout(h, w)` (each [rows of one frame, ...]) for every frame of every item
    of `grid`, in patch order: each frame size laid out once (`item_layouts`)."""
    parts = [tuple(np.tile(a, (t, 1)) if t > 1 else a for a in tables)
             for t, _, _, _, tables in item_layouts(grid, layout)]
    return tuple(np.concatenate(column) for column in zip(*parts))


def check_grid(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """`grid_thw` as int64 [M, 3], M >= 1, h and w multiples of `merge`."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    if len(grid) == 0:
        raise ValueError("encoder_metadata needs at least one item")
    if (grid <= 0).any() or (grid[:, 1:] % merge).any():
        raise ValueError(f"grid_thw rows must be positive with h and w multiples of {merge}: {grid.tolist()}")
    return grid


def num_patches(grid_thw: np.ndarray) -> int:
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return int(grid.prod(axis=1).sum())


def patch_positions(h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of every patch of an h x w grid in processor order: merge block row, merge
    block column, then the m x m patches of the block, i.e. (bh, bw, i, j) -> (bh*m + i, bw*m + j)."""
    bh, bw, i, j = np.meshgrid(np.arange(h // m), np.arange(w // m), np.arange(m), np.arange(m), indexing="ij")
    return (bh * m + i).reshape(-1), (bw * m + j).reshape(-1)


def rotary_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """2-D rotary: each of the two axes rotates a quarter of the head's frequencies."""
    spatial_dim = head_dim // 2
    return (1.0 / (theta ** (np.arange(0, spatial_dim, 2, dtype=np.float64) / spatial_dim))).astype(np.float32)


def rotary_tables(hpos: np.ndarray, wpos: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin [N, head_dim] for patches at (hpos, wpos): `[h-freqs, w-freqs, h-freqs, w-freqs]`,
    angles formed as transformers does (float32 position * float32 inv_freq), rounded once."""
    size = int(max(hpos.max(), wpos.max())) + 1
    angles = (np.arange(size, dtype=np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    cos_t, sin_t = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    cos = np.concatenate([cos_t[hpos], cos_t[wpos]], axis=1)
    sin = np.concatenate([sin_t[hpos], sin_t[wpos]], axis=1)
    return np.concatenate([cos, cos], axis=1), np.concatenate([sin, sin], axis=1)


def example_inputs(settings: dict[str, Any], encoder_metadata, grid_thw) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Random float32 pixel rows for `grid_thw` and their metadata (tracing, smoke tests)."""
    grid = np.asarray(grid_thw, dtype=np.int64)
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((num_patches(grid), settings["patch_dim"])).astype(np.float32)
    return pixels, encoder_metadata(grid, settings)


# ONNX dynamic axes of the rotary and per-frame group inputs (`frame_profile`'s).
FRAME_AXES: dict[str, dict[int, str]] = {
    "rotary_cos": {0: "patches"}, "rotary_sin": {0: "patches"},
    "full_index": {0: "frames", 1: "frame_len"}, "full_mask": {0: "frames", 1: "frame_len"},
    "full_inverse": {0: "patches"},
}
