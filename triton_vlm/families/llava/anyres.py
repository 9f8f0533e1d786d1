"""LLaVA-OneVision's rows after the tower (numpy only: the `vision_encoder` front counts them
without torch): each output row a weighted sum of at most four rows of [the run's view features;
`image_newline`] (`feature_index`, `feature_weight`), which is transformers' `pack_image_features`
(the tiles' canvas, `unpad_image`, the "anyres_max" bilinear cut, a newline ending each row, after
the base view; one newline after a view of one of several images) and `get_video_features` (each
frame pooled bilinearly to ceil(S / 2) a side, one newline after the frames). Bilinear weights are
torch's `interpolate(mode="bilinear", align_corners=False)` ones.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from triton_vlm.errors import InvalidInput
from triton_vlm.families.llava.onevision import anyres_shape, best_resolution


def bilinear_taps(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray]:
    """torch's bilinear resize along one axis (align_corners False): for each output index, the
    two input indices [size_out, 2] and their weights [size_out, 2], as its CPU kernel computes them
    (float32)."""
    scale = np.float32(size_in) / np.float32(size_out)
    src = np.maximum((np.arange(size_out, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5), 0)
    i0 = np.minimum(src.astype(np.int64), size_in - 1)
    i1 = i0 + (i0 < size_in - 1)
    l1 = np.clip(src - i0.astype(np.float32), 0, 1).astype(np.float32)
    return np.stack([i0, i1], 1), np.stack([1 - l1, l1], 1).astype(np.float32)


def _resized(grid_index: np.ndarray, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """A [h, w] grid of feature rows resized bilinearly to `size`: (index, weight) [h' * w', 4]."""
    (yi, yw), (xi, xw) = bilinear_taps(grid_index.shape[0], size[0]), bilinear_taps(grid_index.shape[1], size[1])
    index = grid_index[yi[:, None, :, None], xi[None, :, None, :]]           # [h', w', 2, 2]
    weight = yw[:, None, :, None] * xw[None, :, None, :]
    return index.reshape(-1, 4), weight.reshape(-1, 4).astype(np.float32)


def _plain(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    index = np.zeros((len(rows), 4), np.int64)
    index[:, 0] = rows
    weight = np.zeros((len(rows), 4), np.float32)
    weight[:, 0] = 1
    return index, weight


def _tiles_canvas(views: int, size: tuple[int, int], settings: dict[str, Any], first: int, newline: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """One image's tiles (views 1.. of its row) as transformers' feature canvas, unpadded, cut, each
    of its rows ended by the newline."""
    side, tile = settings["side"], settings["image_size"]
    height, width = size
    bh, bw = best_resolution(height, width, settings["image_grid_pinpoints"])
    tiles = (bh // tile, bw // tile)
    if views != 1 + tiles[0] * tiles[1]:
        raise InvalidInput(f"grid_thw: an image of {height} x {width} has {1 + tiles[0] * tiles[1]} views, got {views}")
    (uh, uw), cut = anyres_shape(height, width, side, tiles, settings["vision_aspect_ratio"])
    y, x = np.arange(tiles[0] * side)[:, None], np.arange(tiles[1] * side)[None, :]
    canvas = first + side * side * (1 + (y // side) * tiles[1] + x // side) + (y % side) * side + x % side
    top, left = (canvas.shape[0] - uh) // 2, (canvas.shape[1] - uw) // 2
    index, weight = _resized(canvas[top:top + uh, left:left + uw], cut)
    end_index, end_weight = _plain(np.full(cut[0], newline))
    return (np.concatenate([index.reshape(*cut, 4), end_index[:, None]], 1).reshape(-1, 4),
            np.concatenate([weight.reshape(*cut, 4), end_weight[:, None]], 1).reshape(-1, 4))


def item_plan(views: int, size: tuple[int, int], settings: dict[str, Any], first: int, newline: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """(index, weight) [rows, 4] of one grid row's output, its view features starting at row
    `first` of the table, `newline` the table's newline row."""
    side = settings["side"]
    views_grid = first + np.arange(views * side * side).reshape(views, side, side)
    if size == (0, 0):  # a video: each frame pooled to ceil(S / 2) a side, one newline after the frames
        pooled = math.ceil(side / 2)
        parts = [_resized(frame, (pooled, pooled)) for frame in views_grid] + [_plain(np.array([newline]))]
    elif views == 1:  # one of several images: its features, one newline
        parts = [_plain(views_grid[0].reshape(-1)), _plain(np.array([newline]))]
    else:  # one image: the base view's features, then its tiles' canvas
        parts = [_plain(views_grid[0].reshape(-1)), _tiles_canvas(views, size, settings, first, newline)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def check_sizes(grid_thw: np.ndarray, image_sizes: np.ndarray | None, settings: dict[str, Any]) -> np.ndarray:
    """`image_sizes` int64 [M, 2] checked against the grid: every row [views, S, S]."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    side = settings["side"]
    if (grid[:, 1:] != side).any() or (grid[:, 0] <= 0).any():
        raise InvalidInput(f"grid_thw: LLaVA-OneVision's tower takes views of {side} x {side} patches, "
                           f"got {grid.tolist()}")
    sizes = np.zeros((len(grid), 2), np.int64) if image_sizes is None else np.asarray(image_sizes, np.int64)
    if sizes.shape != (len(grid), 2) or (sizes < 0).any():
        raise InvalidInput(f"image_sizes: expected [{len(grid)}, 2] non-negative (height, width), got "
                           f"{list(sizes.shape)}")
    return sizes


def feature_plan(grid_thw: np.ndarray, settings: dict[str, Any], image_sizes: np.ndarray | None = None
                 ) -> dict[str, np.ndarray]:
    """`feature_index` int64 and `feature_weight` float32 [output rows, 4] of one run."""
    sizes = check_sizes(grid_thw, image_sizes, settings)
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    newline = int(grid[:, 0].sum()) * settings["side"] ** 2
    plans, first = [], 0
    for (views, _, _), size in zip(grid.tolist(), sizes.tolist()):
        plans.append(item_plan(views, tuple(size), settings, first, newline))
        first += views * settings["side"] ** 2
    if not plans:
        return {"feature_index": np.zeros((0, 4), np.int64), "feature_weight": np.zeros((0, 4), np.float32)}
    return {"feature_index": np.concatenate([p[0] for p in plans]),
            "feature_weight": np.concatenate([p[1] for p in plans])}


def embedding_rows(grid_thw: np.ndarray, settings: dict[str, Any], extras: Mapping[str, np.ndarray] | None = None
                   ) -> np.ndarray:
    """Embedding rows of each grid row (`Tower.ROWS`), by its `image_sizes` extra."""
    sizes = check_sizes(grid_thw, (extras or {}).get("image_sizes"), settings)
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    return np.array([len(item_plan(v, tuple(s), settings, 0, 0)[0]) for (v, _, _), s in zip(grid.tolist(), sizes.tolist())],
                    dtype=np.int64)
