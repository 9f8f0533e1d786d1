"""The tensors of the paged KV cache and of the recurrent states, owned by the model runner.

K and V of every attention layer live in `KVCache.k` / `.v` [layers, blocks * block_size, kv_heads,
head_dim]; a token's slot is `block * block_size + offset` (`triton_vlm.llm.block_manager` says
which blocks belong to which sequence). `StateCache` holds the linear-attention layers' recurrent
state, one slot per running sequence. `DecodeCache` is the CPU attention's dense mirror of the
decoding sequences' K/V (see `triton_vlm.llm.attention`).
"""
from __future__ import annotations

import torch

from triton_vlm.llm.linear_attention import STATE_DTYPE


def token_slots(blocks: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Slot of every token 0 .. num_tokens-1 of a sequence with this block table (host tensor)."""
    table = torch.tensor(blocks[:-(-num_tokens // block_size)], dtype=torch.long)
    return (table[:, None] * block_size + torch.arange(block_size)[None, :]).reshape(-1)[:num_tokens]


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        shape = (num_layers, self.num_blocks * self.block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> "KVCache":
        """K/V for the config's attention layers only."""
        return cls(len(config.kv_layers), config.num_kv_heads, config.head_dim, num_blocks, block_size, dtype, device)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class StateCache:
    """The recurrent state of the linear-attention layers, one slot per running sequence:
    `conv` [layers, slots, conv_dim, conv_kernel - 1] (the causal conv's last inputs) and
    `recurrent` [layers, slots, v_heads, k_head_dim, v_head_dim] (the delta-rule state). Slots come
    from the block manager (lowest free first); the tensors grow (doubling, up to `max_slots`) to
    hold the highest slot in use. `reset` zeroes a slot when a sequence starts at token 0.
    `conv` is in the model's dtype (`dtype`), `recurrent` in float32 whatever it is, as transformers
    keeps them (`triton_vlm.llm.linear_attention.STATE_DTYPE`)."""

    def __init__(self, num_layers: int, max_slots: int, conv_shape: tuple[int, ...],
                 recurrent_shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.max_slots = max(1, int(max_slots))
        self.conv = torch.zeros((num_layers, 0, *conv_shape), dtype=dtype, device=device)
        self.recurrent = torch.zeros((num_layers, 0, *recurrent_shape), dtype=STATE_DTYPE, device=device)

    @classmethod
    def for_model(cls, config, max_slots: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> "StateCache":
        lin = config.linear_attention
        return cls(len(config.layer_types) - len(config.kv_layers), max_slots, lin.conv_state_shape,
                   lin.recurrent_state_shape, dtype, device)

    @property
    def capacity(self) -> int:
        return self.conv.shape[1]

    def ensure(self, slot: int) -> None:
        """Room for `slot` (grown by doubling; existing slots keep their values)."""
        old = self.capacity
        if slot < old:
            return
        if slot >= self.max_slots:
            raise RuntimeError(f"state slot {slot} is beyond the {self.max_slots} slots")
        new = min(self.max_slots, max(slot + 1, 2 * old))
        grown = [t.new_zeros((t.shape[0], new, *t.shape[2:])) for t in (self.conv, self.recurrent)]
        grown[0][:, :old], grown[1][:, :old] = self.conv, self.recurrent
        self.conv, self.recurrent = grown

    def reset(self, slot: int) -> None:
        self.ensure(slot)
        self.conv[:, slot] = 0
        self.recurrent[:, slot] = 0


class DecodeCache:
    """Dense copies of the K/V of the sequences decoding now, so a decode step reads them without
    gathering every block of every layer again (the KV cache stays the source of truth).

    `k` / `v` [layers, rows, kv_heads, length, head_dim]: row r holds tokens `0 .. lengths[r]` of
    the sequence `keys[r]`. A step passes its decode sequences (key, start, slots); rows of sequences
    not decoding in this step, or not exactly at `start`, are dropped (finished, preempted,
    cancelled, failed); a sequence new to decoding is copied in from the KV cache once, all layers
    in one gather. The buffers grow on demand up to `limit_bytes`; past that, `prepare` returns None
    and the caller gathers from the KV cache as before."""

    def __init__(self, kv: KVCache, limit_bytes: int):
        self.kv, self.limit_bytes = kv, int(limit_bytes)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.keys: list = []
        self.lengths: list[int] = []
        self.rebuilt_rows = 0  # sequences copied in from the KV cache (counter, for tests/benchmarks)

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    def clear(self) -> None:
        self.k = self.v = None
        self.keys, self.lengths = [], []

    def _bytes(self, rows: int, length: int) -> int:
        p = self.kv
        return 2 * p.k.shape[0] * rows * p.k.shape[2] * length * p.k.shape[3] * p.k.element_size()

    def prepare(self, seqs: list[tuple[object, int, list[int]]]) -> list[int] | None:
        """Rows for decode sequences (key, start, block table); on return row
        `rows[j]` holds tokens 0 .. start_j of sequence j and has room for token start_j. Every row
        of the buffer belongs to one of `seqs` (rows 0 .. len(seqs)). None: over the byte limit."""
        want = {key: start for key, start, _ in seqs}
        if len(want) != len(seqs) or any(key is None for key in want):
            self.clear()
            return None
        keep = [r for r, key in enumerate(self.keys) if want.get(key, -1) == self.lengths[r]]
        n_keep = len(keep)
        # compact: kept rows past n_keep move into the holes before it
        holes = [r for r in range(n_keep) if r not in set(keep)]
        tail = [r for r in keep if r >= n_keep]
        for dst, src in zip(holes, tail):
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]
            self.keys[dst], self.lengths[dst] = self.keys[src], self.lengths[src]
        del self.keys[n_keep:], self.lengths[n_keep:]
        rows_needed = len(seqs)
        len_needed = max(start + 1 for _, start, _ in seqs)
        cap_rows = 0 if self.k is None else self.k.shape[1]
        cap_len = 0 if self.k is None else self.k.shape[3]
        if rows_needed > cap_rows or len_needed > cap_len:
            bs = self.kv.block_size
            new_rows = max(rows_needed, cap_rows, -(-rows_needed * 5 // 4 // 8) * 8)
            new_len = max(cap_len, -(-(len_needed + len_needed // 4 + 64) // bs) * bs)
            if self._bytes(new_rows, new_len) > self.limit_bytes:
                new_rows, new_len = max(rows_needed, cap_rows), max(len_needed, cap_len)
                if self._bytes(new_rows, new_len) > self.limit_bytes:
                    self.clear()
                    return None
            p = self.kv
            shape = (p.k.shape[0], new_rows, p.k.shape[2], new_len, p.k.shape[3])
            # zeros, not empty: SDPA multiplies the masked-out tail by 0 weights, and 0 * NaN is NaN
            k, v = p.k.new_zeros(shape), p.v.new_zeros(shape)
            if self.keys:
                n, m = len(self.keys), max(self.lengths)
                k[:, :n, :, :m] = self.k[:, :n, :, :m]
                v[:, :n, :, :m] = self.v[:, :n, :, :m]
            self.k, self.v = k, v
        row_of = {key: r for r, key in enumerate(self.keys)}
        rows = []
        for key, start, blocks in seqs:
            r = row_of.get(key)
            if r is None:  # new to decoding: copy its tokens in from the KV cache, all layers at once
                r = len(self.keys)
                self.keys.append(key)
                self.lengths.append(start)
                idx = token_slots(blocks, start, self.kv.block_size).to(self.kv.k.device)
                self.k[:, r, :, :start] = self.kv.k.index_select(1, idx).transpose(1, 2)
                self.v[:, r, :, :start] = self.kv.v.index_select(1, idx).transpose(1, 2)
                self.rebuilt_rows += 1
            rows.append(r)
        return rows

    def advance(self, rows: list[int]) -> None:
        """The step wrote one more token into each of these rows."""
        for r in rows:
            self.lengths[r] += 1
