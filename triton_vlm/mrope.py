"""3-D rotary positions (M-RoPE) of a prompt, by the reference rule (vLLM's
`get_mrope_input_positions`):

- text tokens get the same position on all three axes, counting up by one;
- a media item's tokens get (t, h, w) grid positions offset by the position its first token
  would have had as text; the temporal index is `int(t * t_factor)`;
- the text after a media item starts at `max(all previous positions) + 1`.

Vectorised per media item; no per-token Python loop.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MediaSpan:
    """One run of media tokens in the expanded prompt: a media item, or one temporal patch of a
    video whose frames the family separates with text (GLM's timestamps)."""
    offset: int        # index of its first placeholder token
    grid_t: int        # LLM grid after the spatial merge
    grid_h: int
    grid_w: int
    t_factor: float = 1.0  # temporal position scale (Qwen2.5-VL video: second_per_grid_ts * tokens_per_second)

    @property
    def length(self) -> int:
        return self.grid_t * self.grid_h * self.grid_w


def mrope_positions(seq_len: int, spans: list[MediaSpan]) -> tuple[np.ndarray, int]:
    """Positions int64 [3, seq_len] and the delta `max(position) + 1 - seq_len`."""
    positions = np.empty((3, seq_len), dtype=np.int64)
    st = 0          # next token index not yet placed
    next_pos = 0    # max(previous positions) + 1
    for span in sorted(spans, key=lambda s: s.offset):
        if span.offset < st or span.offset + span.length > seq_len:
            raise ValueError("media spans overlap or run past the prompt")
        text_len = span.offset - st
        positions[:, st:span.offset] = np.arange(next_pos, next_pos + text_len, dtype=np.int64)
        base = next_pos + text_len
        t_idx = np.arange(span.grid_t, dtype=np.int64)
        if span.t_factor != 1.0:
            t_idx = (t_idx * span.t_factor).astype(np.int64)
        end, hw = span.offset + span.length, span.grid_h * span.grid_w
        positions[0, span.offset:end] = np.repeat(t_idx + base, hw)
        positions[1, span.offset:end] = np.tile(np.repeat(np.arange(base, base + span.grid_h), span.grid_w),
                                                span.grid_t)
        positions[2, span.offset:end] = np.tile(np.arange(base, base + span.grid_w), span.grid_t * span.grid_h)
        if span.length:
            next_pos = base + max(int(t_idx[-1]), span.grid_h - 1, span.grid_w - 1) + 1
        else:
            next_pos = base
        st = span.offset + span.length
    if st < seq_len:
        positions[:, st:] = np.arange(next_pos, next_pos + seq_len - st, dtype=np.int64)
        next_pos += seq_len - st
    delta = int(next_pos - seq_len) if seq_len else 0
    return positions, delta
