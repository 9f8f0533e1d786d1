"""MiniCPM-V 2.5's padded slices, numpy only: the official batched `vpm` call zero-pads every slice
of a request to the request's largest, and each grid row's padded size travels as the
`padded_patches` extra. `padded_frames` checks it, for the tower's metadata and, through
`embedding_rows` (the tower's `Tower.ROWS`), for the torch-free encoder front, which refuses a bad
one as the request's fault before it reaches the batched model.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from triton_vlm.contract.limits import Limits
from triton_vlm.errors import InvalidInput
from triton_vlm.vision.tower import rows


def padded_frames(grid: np.ndarray, padded_patches: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(patches, padded patches) of every frame of `grid` [M, 3]: its grid row's `padded_patches`
    (none, 0: its own h * w). InvalidInput (naming `padded_patches`) for a frame padded to fewer
    patches than it holds, or to more than a frame may hold (`Limits.max_frame_patches`)."""
    grid = np.asarray(grid, dtype=np.int64).reshape(-1, 3)
    own = grid[:, 1] * grid[:, 2]
    given = np.zeros(len(grid), np.int64) if padded_patches is None else np.asarray(padded_patches, np.int64)
    given = given.reshape(-1)
    real, padded = np.repeat(own, grid[:, 0]), np.repeat(np.where(given > 0, given, own), grid[:, 0])
    limit = Limits().max_frame_patches
    if bad := np.flatnonzero((padded < real) | (padded > limit)).tolist():
        raise InvalidInput(f"padded_patches: frame {bad[0]} of {real[bad[0]]} patches padded to {padded[bad[0]]}; "
                           f"each must lie in [its frame's h * w, max_frame_patches={limit}]")
    return real, padded


def embedding_rows(grid_thw: np.ndarray, settings: dict[str, Any],
                   extras: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """The resampler's `query_num` rows per grid row (`rows.embedding_rows`), once the grid's
    `padded_patches` are checked."""
    padded_frames(grid_thw, (extras or {}).get("padded_patches"))
    return rows.embedding_rows(grid_thw, settings, extras)
