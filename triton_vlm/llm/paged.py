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
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import torch


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 prefix_caching: bool = False, dtype: torch.dtype = torch.float32):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs >= 1 block of >= 1 token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.prefix_caching = bool(prefix_caching)
        shape = (num_layers, self.num_blocks * self.block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.nbytes = 2 * self.k.numel() * self.k.element_size()
        self._free: deque[int] = deque(range(self.num_blocks))  # never keyed, or key dropped
        self._ref = [0] * self.num_blocks
        self._key: list[bytes | None] = [None] * self.num_blocks
        self._cached: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced, LRU first
        self.hits = 0  # blocks reused from the prefix cache

    @classmethod
    def for_model(cls, config, num_tokens: int, block_size: int, prefix_caching: bool = False) -> "KVPool":
        blocks = -(-int(num_tokens) // int(block_size))
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, blocks, block_size, prefix_caching)

    # ---- counts --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (cached but unreferenced blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

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
        """Slot of every token 0 .. num_tokens-1 of a sequence with this block table."""
        bs = self.block_size
        table = torch.tensor(blocks[:self.blocks_for(num_tokens)], dtype=torch.long)
        return (table[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)[:num_tokens]


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
