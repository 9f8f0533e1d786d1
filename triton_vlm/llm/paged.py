"""The paged KV cache: one preallocated pool of fixed-size blocks, reference-counted, with prefix caching.

K and V of every layer live in `k` / `v` [layers, blocks * block_size, kv_heads, head_dim]; a token's
slot is `block * block_size + offset`. A sequence owns a block table (a list of block ids); blocks go
back to the pool the moment it ends, is cancelled, fails or is preempted.

Prefix caching: a full block of prompt tokens gets a key chained from the previous block's key and
this block's token ids, M-RoPE positions and (for image/video placeholder rows) the bytes of the
embedding rows. The `llm` model receives only `input_ids` and `embeddings`, never the media hashes
`preprocess` computes; hashing the embedding rows themselves is exact (equal keys mean equal inputs,
so equal K/V), costs one pass over the rows at submit, and needs no new tensor in the contract.
An unreferenced cached block stays keyed (counted as free) until the allocator reclaims it, LRU.

Hybrid decoders (linear-attention layers, `triton_vlm.llm.linear_attention`) also keep a fixed-size
recurrent state per sequence (`StatePool`, the pool's `states`). That state sums up every token
before it, so a cached block of K/V is not enough to resume a sequence there: the engine turns
prefix caching off for such decoders (`DecoderConfig.recurrent`).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import torch

from triton_vlm.llm.linear_attention import STATE_DTYPE


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 prefix_caching: bool = False, dtype: torch.dtype = torch.float32,
                 decode_cache_bytes: int | None = None, states: "StatePool | None" = None,
                 device: str | torch.device = "cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs >= 1 block of >= 1 token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.prefix_caching = bool(prefix_caching)
        shape = (num_layers, self.num_blocks * self.block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.nbytes = 2 * self.k.numel() * self.k.element_size()
        self._free: deque[int] = deque(range(self.num_blocks))  # never keyed, or key dropped
        self._ref = [0] * self.num_blocks
        self._key: list[bytes | None] = [None] * self.num_blocks
        self._cached: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced, LRU first
        self.hits = 0  # blocks reused from the prefix cache
        # dense K/V of the decoding sequences (see DecodeCache); default: up to half the pool's bytes
        self.decode_cache = DecodeCache(self, self.nbytes // 2 if decode_cache_bytes is None else decode_cache_bytes)
        self.states = states

    @classmethod
    def for_model(cls, config, num_tokens: int, block_size: int, prefix_caching: bool = False,
                  state_slots: int = 1, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> "KVPool":
        """K/V for the config's attention layers only, in the model's dtype; a StatePool of up to
        `state_slots` sequences for its linear-attention layers (with no layers when it has none)."""
        blocks = -(-int(num_tokens) // int(block_size))
        return cls(len(config.kv_layers), config.num_kv_heads, config.head_dim, blocks, block_size, prefix_caching,
                   dtype=dtype, states=StatePool.for_model(config, state_slots, dtype, device), device=device)

    # ---- counts --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (cached but unreferenced blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.block_size)

    # ---- allocation ----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n blocks, or None (nothing taken) if fewer are free."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._key[b]]
                self._key[b] = None
            self._ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] < 0:
                raise RuntimeError(f"KV block {b} released twice")
            if self._ref[b] == 0:
                if self._key[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # ---- prefix cache --------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> list[int]:
        """Blocks for the longest cached prefix of `keys`, each now referenced by the caller."""
        out = []
        if not self.prefix_caching:
            return out
        for key in keys:
            b = self._cached.get(key)
            if b is None:
                break
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
            out.append(b)
        self.hits += len(out)
        return out

    def register(self, block: int, key: bytes) -> None:
        """Mark a computed full prompt block as reusable under `key`."""
        if self.prefix_caching and key not in self._cached and self._key[block] is None:
            self._cached[key] = block
            self._key[block] = key

    def slots(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """Slot of every token 0 .. num_tokens-1 of a sequence with this block table (on the pool's device)."""
        bs = self.block_size
        table = torch.tensor(blocks[:self.blocks_for(num_tokens)], dtype=torch.long, device=self.k.device)
        return (table[:, None] * bs + torch.arange(bs, device=self.k.device)[None, :]).reshape(-1)[:num_tokens]


def block_keys(input_ids: torch.Tensor, positions: torch.Tensor, embeddings: torch.Tensor | None,
               placeholder_mask: torch.Tensor, block_size: int) -> list[bytes]:
    """Chained keys of the full blocks of a prompt (see the module docstring)."""
    n = int(input_ids.numel())
    keys, prev = [], b""
    rows_before = torch.cumsum(placeholder_mask.long(), 0) - placeholder_mask.long()
    ids = input_ids.to(torch.int64).contiguous()
    pos = positions.to(torch.int64).contiguous()
    for start in range(0, n - n % block_size, block_size):
        end = start + block_size
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(ids[start:end].numpy().tobytes())
        h.update(pos[:, start:end].contiguous().numpy().tobytes())
        m = int(placeholder_mask[start:end].sum())
        if m and embeddings is not None:
            first = int(rows_before[start])
            h.update(embeddings[first:first + m].contiguous().numpy().tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


class DecodeCache:
    """Dense copies of the K/V of the sequences decoding now, so a decode step reads them without
    gathering every block of every layer again (the pool stays the source of truth).

    `k` / `v` [layers, rows, kv_heads, length, head_dim]: row r holds tokens `0 .. lengths[r]` of
    the sequence `keys[r]`. A step passes its decode sequences (key, start, slots); rows of sequences
    not decoding in this step, or not exactly at `start`, are dropped (finished, preempted,
    cancelled, failed); a sequence new to decoding is copied in from the pool once, all layers in
    one gather. The buffers grow on demand up to `limit_bytes`; past that, `prepare` returns None
    and the caller gathers from the pool as before."""

    def __init__(self, pool: "KVPool", limit_bytes: int):
        self.pool, self.limit_bytes = pool, int(limit_bytes)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.keys: list = []
        self.lengths: list[int] = []
        self.rebuilt_rows = 0  # sequences copied in from the pool (counter, for tests/benchmarks)

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    def clear(self) -> None:
        self.k = self.v = None
        self.keys, self.lengths = [], []

    def _bytes(self, rows: int, length: int) -> int:
        p = self.pool
        return 2 * p.k.shape[0] * rows * p.k.shape[2] * length * p.k.shape[3] * p.k.element_size()

    def prepare(self, seqs: list[tuple[object, int, torch.Tensor]]) -> list[int] | None:
        """Rows for decode sequences (key, start, slots of tokens 0 .. start); on return row
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
            bs = self.pool.block_size
            new_rows = max(rows_needed, cap_rows, -(-rows_needed * 5 // 4 // 8) * 8)
            new_len = max(cap_len, -(-(len_needed + len_needed // 4 + 64) // bs) * bs)
            if self._bytes(new_rows, new_len) > self.limit_bytes:
                new_rows, new_len = max(rows_needed, cap_rows), max(len_needed, cap_len)
                if self._bytes(new_rows, new_len) > self.limit_bytes:
                    self.clear()
                    return None
            p = self.pool
            shape = (p.k.shape[0], new_rows, p.k.shape[2], new_len, p.k.shape[3])
            # zeros, not empty: SDPA multiplies the masked-out tail by 0 weights, and 0 * NaN is NaN
            k, v = (torch.zeros(shape, dtype=p.k.dtype, device=p.k.device),
                    torch.zeros(shape, dtype=p.v.dtype, device=p.v.device))
            if self.keys:
                n, m = len(self.keys), max(self.lengths)
                k[:, :n, :, :m] = self.k[:, :n, :, :m]
                v[:, :n, :, :m] = self.v[:, :n, :, :m]
            self.k, self.v = k, v
        row_of = {key: r for r, key in enumerate(self.keys)}
        rows = []
        for key, start, slots in seqs:
            r = row_of.get(key)
            if r is None:  # new to decoding: copy its tokens in from the pool, all layers at once
                r = len(self.keys)
                self.keys.append(key)
                self.lengths.append(start)
                idx = slots[:start]
                self.k[:, r, :, :start] = self.pool.k.index_select(1, idx).transpose(1, 2)
                self.v[:, r, :, :start] = self.pool.v.index_select(1, idx).transpose(1, 2)
                self.rebuilt_rows += 1
            rows.append(r)
        return rows

    def advance(self, rows: list[int]) -> None:
        """The step wrote one more token into each of these rows."""
        for r in rows:
            self.lengths[r] += 1


class StatePool:
    """The recurrent state of the linear-attention layers, one slot per running sequence:
    `conv` [layers, slots, conv_dim, conv_kernel - 1] (the causal conv's last inputs) and
    `recurrent` [layers, slots, v_heads, k_head_dim, v_head_dim] (the delta-rule state).
    A sequence takes a slot when it starts running and gives it back when it ends or is preempted
    (then it is recomputed from its prompt); the model zeroes a slot when a sequence starts at token 0.
    The buffers grow (doubling) as more sequences run at once, up to `max_slots`.
    `conv` is in the model's dtype (`dtype`), `recurrent` in float32 whatever it is, as transformers
    keeps them (`triton_vlm.llm.linear_attention.STATE_DTYPE`)."""

    def __init__(self, num_layers: int, max_slots: int, conv_shape: tuple[int, ...],
                 recurrent_shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        self.max_slots = max(1, int(max_slots))
        self.conv = torch.zeros((num_layers, 0, *conv_shape), dtype=dtype, device=device)
        self.recurrent = torch.zeros((num_layers, 0, *recurrent_shape), dtype=STATE_DTYPE, device=device)
        self._free: deque[int] = deque()
        self._used: set[int] = set()

    @classmethod
    def for_model(cls, config, max_slots: int, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> "StatePool":
        lin = config.linear_attention
        if lin is None:
            return cls(0, max_slots, (0,), (0,), dtype, device)
        return cls(len(config.layer_types) - len(config.kv_layers), max_slots, lin.conv_state_shape,
                   lin.recurrent_state_shape, dtype, device)

    @property
    def capacity(self) -> int:
        return self.conv.shape[1]

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        if not self._free:
            old = self.capacity
            new = min(self.max_slots, max(1, 2 * old))
            if new == old:
                raise RuntimeError(f"all {self.max_slots} recurrent-state slots are in use")
            grown = [torch.zeros((t.shape[0], new, *t.shape[2:]), dtype=t.dtype, device=t.device)
                     for t in (self.conv, self.recurrent)]
            grown[0][:, :old], grown[1][:, :old] = self.conv, self.recurrent
            self.conv, self.recurrent = grown
            self._free.extend(range(old, new))
        slot = self._free.popleft()
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} is not in use")
        self._used.discard(slot)
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        self.conv[:, slot] = 0
        self.recurrent[:, slot] = 0
