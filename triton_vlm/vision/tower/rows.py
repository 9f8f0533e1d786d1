"""Embedding rows of each grid row, numpy only: what a tower gives for an item, counted once
(`Tower.ROWS`), by the tower, the encoders and the torch-free `vision_encoder` front alike."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np


def embedding_rows(grid_thw: np.ndarray, settings: dict[str, Any],
                   extras: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """int64 [M]: the settings' `query_num` per grid row (a resampler's learned queries, whatever
    the row's size), or with none one per `spatial_merge_size`^2 patches plus `extra_rows` per frame
    (a class token kept, +1, or the first token dropped, -1)."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    if settings.get("query_num"):
        return np.full(len(grid), int(settings["query_num"]), dtype=np.int64)
    merge, extra = int(settings["spatial_merge_size"]), int(settings.get("extra_rows", 0))
    return grid.prod(axis=1) // merge ** 2 + extra * grid[:, 0]
