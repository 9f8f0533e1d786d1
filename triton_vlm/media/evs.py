"""Efficient Video Sampling (EVS): video tokens that repeat the previous frame are dropped before
the decoder, as the reference does (vLLM `compute_retention_mask`, `video_pruning_rate` q).

For one video's merged embeddings [T, H', W', D]: a token of frame t > 0 scores
1 - cosine(token, same position in frame t - 1); frame 0 always stays; the
`retained_tokens(T, H'W', q)` highest scores are kept (stable order: ties go to the earlier
token), in their original order. The count depends on the grid alone, so `preprocess` writes that
many placeholders before the encoder runs; which tokens stay is known only after it.
"""
from __future__ import annotations

import numpy as np


def check_rate(q: float, name: str) -> float:
    """`q` as a pruning rate in [0, 1), else ValueError naming `name`."""
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 <= q < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {q!r}")
    return float(q)


def retained_tokens(grid_t: int, tokens_per_frame: int, q: float) -> int:
    """Tokens kept of a video of `grid_t` temporal patches: at least one frame's worth."""
    return max(tokens_per_frame, int(grid_t * tokens_per_frame * (1 - q)))


def retention_mask(embeddings: np.ndarray, grid: tuple[int, int, int], q: float) -> np.ndarray:
    """bool [T * H' * W']: which of one video's merged rows (row-major t, h, w) stay. torch's
    `cosine_similarity` and stable `argsort`, as the reference computes them, so that near-equal
    scores order the same way."""
    import torch

    t, h, w = grid
    emb = torch.from_numpy(np.ascontiguousarray(embeddings, dtype=np.float32)).reshape(t, h, w, -1)
    dissimilarity = 1 - torch.nn.functional.cosine_similarity(emb[1:], emb[:-1], dim=-1)
    first = torch.full((1, h, w), 255.0, dtype=dissimilarity.dtype)  # frame 0 always stays
    scores = torch.cat([first, dissimilarity]).reshape(-1)
    order = torch.argsort(scores, descending=True, stable=True)
    mask = np.zeros(t * h * w, dtype=bool)
    mask[order[:retained_tokens(t, h * w, q)].numpy()] = True
    return mask


def prune(embeddings: np.ndarray, grid_thw: np.ndarray, merge: int, q: float) -> tuple[np.ndarray, np.ndarray]:
    """(kept rows, their indices among `embeddings`' rows) of a request's media items (`grid_thw`
    rows in prompt order, `merge` patches per token along each side). q = 0, and any item of one
    temporal patch (every image), keeps every row."""
    index = np.arange(embeddings.shape[0], dtype=np.int64)
    if q == 0.0:
        return embeddings, index
    keep, start = np.ones(embeddings.shape[0], dtype=bool), 0
    for t, h, w in grid_thw.tolist():
        grid = (t, h // merge, w // merge)
        end = start + grid[0] * grid[1] * grid[2]
        if t > 1:
            keep[start:end] = retention_mask(embeddings[start:end], grid, q)
        start = end
    return embeddings[keep], index[keep]
