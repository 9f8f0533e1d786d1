"""The KV block manager: which blocks of the paged KV cache (and which recurrent-state slots) belong
to whom. Integers only: the tensors live in the model runner (`triton_vlm.llm.engine.runner`).

Blocks are reference-counted: a block shared through the prefix cache goes back to the free list
when its last holder releases it. Prefix caching: a full block of prompt tokens gets a key chained
from the previous block's key and this block's token ids, M-RoPE positions and (for image/video
placeholder rows) the bytes of the embedding rows. The `llm` model receives only `input_ids` and
`embeddings`, never the media hashes `preprocess` computes; hashing the embedding rows themselves
is exact (equal keys mean equal inputs, so equal K/V), costs one pass over the rows at submit, and
needs no new tensor in the contract. An unreferenced cached block stays keyed (counted as free)
until an allocation reclaims it, least recently released first.

Hybrid decoders (linear-attention layers, `triton_vlm.llm.layers.linear_attention`) also keep a fixed-size
recurrent state per running sequence: one state slot each, lowest free slot first so the runner's
state tensors stay as small as the number of sequences running at once. That state sums up every
token before it, so a cached block of K/V is not enough to resume a sequence there: the engine
turns prefix caching off for such decoders (`DecoderConfig.recurrent`).
"""
from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict, deque

import torch


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False, state_slots: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs >= 1 block of >= 1 token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.prefix_caching = bool(prefix_caching)
        self._free: deque[int] = deque(range(self.num_blocks))  # never keyed, or key dropped
        self._ref = [0] * self.num_blocks
        self._key: list[bytes | None] = [None] * self.num_blocks
        self._cached: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced, LRU first
        self.hits = 0  # blocks reused from the prefix cache
        self.state_slots = int(state_slots)
        self._free_states = list(range(self.state_slots))  # a heap: lowest slot first
        self._used_states: set[int] = set()

    # ---- counts --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (cached but unreferenced blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_states_used(self) -> int:
        return len(self._used_states)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.block_size)

    # ---- blocks --------------------------------------------------------------------------------
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

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of `blocks` (held: a sequence forked off another's prompt)."""
        for b in blocks:
            if self._ref[b] < 1:
                raise RuntimeError(f"KV block {b} shared while free")
            self._ref[b] += 1

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

    # ---- recurrent-state slots -----------------------------------------------------------------
    def allocate_state(self) -> int:
        if not self._free_states:
            raise RuntimeError(f"all {self.state_slots} recurrent-state slots are in use")
        slot = heapq.heappop(self._free_states)
        self._used_states.add(slot)
        return slot

    def release_state(self, slot: int) -> None:
        if slot not in self._used_states:
            raise RuntimeError(f"state slot {slot} is not in use")
        self._used_states.discard(slot)
        heapq.heappush(self._free_states, slot)


def block_keys(input_ids: torch.Tensor, positions: torch.Tensor, embeddings: torch.Tensor | None,
               placeholder_mask: torch.Tensor, block_size: int, spans: tuple[tuple[int, int], ...] = ()) -> list[bytes]:
    """Chained keys of the full blocks of a prompt (see the module docstring). A block that holds
    part of a bidirectional span (`spans`: its tokens' K/V depend on the span's later tokens too)
    also hashes the span's embedding rows past the block."""
    n = int(input_ids.numel())
    keys, prev = [], b""
    rows_before = torch.cumsum(placeholder_mask.long(), 0) - placeholder_mask.long()
    ids = input_ids.to(torch.int64).contiguous()
    pos = positions.to(torch.int64).contiguous()
    emb = None if embeddings is None else embeddings.detach().cpu()
    for start in range(0, n - n % block_size, block_size):
        end = start + block_size
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(ids[start:end].numpy().tobytes())
        h.update(pos[:, start:end].contiguous().numpy().tobytes())
        reach = max([end] + [b for a, b in spans if a < end and b > end])
        m = int(placeholder_mask[start:reach].sum())
        if m and emb is not None:
            first = int(rows_before[start])
            h.update(emb[first:first + m].contiguous().view(torch.uint8).numpy().tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys
