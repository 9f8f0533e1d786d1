"""3-D rotary positions (M-RoPE) of a prompt, by the reference rule (vLLM's
`get_mrope_input_positions`):

- text tokens get the same position on all three axes, counting up by one;
- a media item's tokens get (t, h, w) grid positions offset by the position its first token
  would have had as text; the temporal index is `int(t * t_factor)`;
- the text after a media item starts at `max(all previous positions) + 1` (`after_max`; a family
  may follow transformers' `after_extent` instead, `ProcessorRules.mrope_text_after`).

With EVS video pruning on (`triton_vlm.media.evs`), the reference recomputes positions once the kept
tokens are known (vLLM `recompute_mrope_positions`): kept tokens keep their unpruned (t, h, w)
coordinates, and the text after each media item starts at the item's base + its grid width W'
(`pruned_mrope_positions`, then `complete_positions` once the encoder has chosen the tokens).

Vectorised per media item; no per-token Python loop.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MediaSpan:
    """One run of media tokens in the expanded prompt: a media item, or one temporal patch of a
    video whose frames the family separates with text (timestamps)."""
    offset: int        # index of its first placeholder token
    grid_t: int        # LLM grid after the spatial merge
    grid_h: int
    grid_w: int
    t_factor: float = 1.0  # temporal position scale (`ProcessorRules.video_t_factor`)
    tokens: int | None = None  # placeholder tokens, where fewer than the grid's (an EVS-pruned video)

    @property
    def grid_size(self) -> int:
        return self.grid_t * self.grid_h * self.grid_w

    @property
    def length(self) -> int:
        return self.grid_size if self.tokens is None else self.tokens


def grid_positions(span: MediaSpan, base: int) -> np.ndarray:
    """int64 [3, grid_size]: the (t, h, w) positions of every grid token of `span`, row-major,
    offset by `base`."""
    t_idx = np.arange(span.grid_t, dtype=np.int64)
    if span.t_factor != 1.0:
        t_idx = (t_idx * span.t_factor).astype(np.int64)
    hw = span.grid_h * span.grid_w
    return np.stack([np.repeat(t_idx, hw),
                     np.tile(np.repeat(np.arange(span.grid_h, dtype=np.int64), span.grid_w), span.grid_t),
                     np.tile(np.arange(span.grid_w, dtype=np.int64), span.grid_t * span.grid_h)]) + base


def _place(seq_len: int, spans: list[MediaSpan], text_after) -> tuple[np.ndarray, int, list[np.ndarray]]:
    """Positions [3, seq_len], delta, and each span's grid positions; `text_after(span, base,
    grid)` is where the text after a span starts."""
    positions = np.empty((3, seq_len), dtype=np.int64)
    grids = []
    st = 0          # next token index not yet placed
    next_pos = 0    # where the next text token goes
    for span in sorted(spans, key=lambda s: s.offset):
        if span.offset < st or span.offset + span.length > seq_len:
            raise ValueError("media spans overlap or run past the prompt")
        text_len = span.offset - st
        positions[:, st:span.offset] = np.arange(next_pos, next_pos + text_len, dtype=np.int64)
        base = next_pos + text_len
        grid = grid_positions(span, base)
        grids.append(grid)
        positions[:, span.offset:span.offset + span.length] = grid[:, :span.length]
        next_pos = text_after(span, base, grid) if span.length else base
        st = span.offset + span.length
    if st < seq_len:
        positions[:, st:] = np.arange(next_pos, next_pos + seq_len - st, dtype=np.int64)
    delta = int(positions.max()) + 1 - seq_len if seq_len else 0
    return positions, delta, grids


def after_max(span: MediaSpan, base: int, grid: np.ndarray) -> int:
    """The reference's rule: the text after a span starts at max(its positions) + 1."""
    return int(grid.max()) + 1


def after_extent(span: MediaSpan, base: int, grid: np.ndarray) -> int:
    """transformers 5.x's `get_rope_index` (Qwen2-VL): the text after a span starts at its base +
    max(grid_h, grid_w), its temporal extent not counted. Equal to `after_max` unless the span's
    last temporal position passes its spatial extent (a long video)."""
    return base + max(span.grid_h, span.grid_w)


def mrope_positions(seq_len: int, spans: list[MediaSpan], text_after=after_max) -> tuple[np.ndarray, int]:
    """Positions int64 [3, seq_len] and the delta `max(position) + 1 - seq_len`; the text after a
    span starts where `text_after(span, base, grid)` says."""
    positions, delta, _ = _place(seq_len, spans, text_after)
    return positions, delta


def pruned_mrope_positions(seq_len: int, spans: list[MediaSpan]) -> tuple[np.ndarray, int, np.ndarray]:
    """The reference's positions with pruning on: (positions [3, seq_len], delta, media positions
    [3, sum of grid sizes]). The text after a media item starts at its base + grid_w; the media
    positions are every grid token's, unpruned, prompt order. A pruned span's own columns hold its
    first grid positions until `complete_positions` puts the kept tokens' there."""
    positions, delta, grids = _place(seq_len, spans, lambda span, base, grid: base + span.grid_w)
    media = np.concatenate(grids, axis=1) if grids else np.zeros((3, 0), np.int64)
    return positions, delta, media


def complete_positions(positions, media_mask, media_positions, kept_rows):
    """Positions with each media token's column set to its row's unpruned position
    (`media_positions[:, kept_rows]`, in order), and the delta `max(position) + 1 - seq_len`.
    numpy arrays or torch tensors alike."""
    positions = positions.clone() if hasattr(positions, "clone") else positions.copy()
    positions[:, media_mask] = media_positions[:, kept_rows]
    return positions, int(positions.max()) + 1 - positions.shape[1]
