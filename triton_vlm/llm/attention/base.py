"""Paged attention: the metadata of a step, built once, and the backend every attention layer calls.

A step's rows are one flat batch: prefill chunks (many rows of one sequence) and decode rows (one
token of a sequence). `TorchAttention.build` turns the step's `SeqRows` into `AttentionMetadata`
(where each row's K/V are written, which blocks each decode row reads, the prefill masks) once per
step; `forward` is then called by every attention layer with that layer's q, k, v:
- it writes the new K/V into their slots of the paged `KVCache`;
- a prefill chunk that starts at token 0 attends causally to its own rows (SDPA on the contiguous
  chunk); one that continues a sequence (chunked prefill, prefix-cache hit, recompute) attends to
  its cached prefix, gathered slot by slot, plus its own rows;
- decode rows attend together, one padded and masked SDPA: the query heads of one KV head attend as
  G "query rows" (no K/V repeat for GQA). Their K/V are gathered block by block through the block
  tables, per layer (a transient copy; no second copy of the KV memory is kept).
Masks are data: a sliding-window layer (`DecoderConfig.kv_windows`) hides the keys `window` or more
positions back, and in prefill a row inside a bidirectional span (`SeqRows.spans`: a media block of
a `bidirectional_media` decoder) also sees the span's later tokens (`row_limits`), which the
scheduler keeps in the row's chunk. Sliding-window layers keep every token's K/V (the block table is
the sequence's, shared by all layers): their memory is a full layer's.

This backend is plain torch and runs on any device; it is the reference the faster kernels of other
backends are compared with.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from triton_vlm.llm.attention.cache import KVCache, token_slots


@dataclass(frozen=True)
class SeqRows:
    """One sequence's rows in a step: batch rows `row .. row + n` are its tokens `start .. start + n`.
    `spans`: the token ranges [a, b) of the sequence whose tokens attend to each other both ways in
    prefill (`DecoderConfig.bidirectional_media`); the scheduler never ends a chunk inside one."""
    row: int
    n: int
    start: int
    blocks: list[int]   # the sequence's block table
    spans: tuple[tuple[int, int], ...] = ()


def row_limits(s: SeqRows) -> torch.Tensor | None:
    """One past the last token each row of a prefill chunk sees [n] long: its own token's next,
    or the end of the bidirectional span it lies in; None when every row is plain causal."""
    limit = None
    for a, b in s.spans:
        lo, hi = max(a, s.start), min(b, s.start + s.n)
        if lo < hi:
            if limit is None:
                limit = torch.arange(s.start + 1, s.start + s.n + 1)
            limit[lo - s.start:hi - s.start] = b
    return limit


def visible(positions: torch.Tensor, limit: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """[rows, length] which of the tokens 0 .. length - 1 each row (its token at `positions`) sees:
    below its `limit`, and with a sliding `window` more than `position - window`."""
    t = torch.arange(length)[None, :]
    seen = t < limit[:, None]
    return seen if window is None else seen & (t > positions[:, None] - window)


@dataclass
class PrefillMeta:
    row: int
    n: int
    start: int
    slots: torch.Tensor | None   # [start + n] slots of the tokens it attends to; None when start == 0
    limit: torch.Tensor | None   # [n] one past the last token each row sees (`row_limits`); None: causal
    masks: dict = field(default_factory=dict)  # by sliding window (None: full), built once per step

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """[n, start + n] which tokens each row sees; None: causal over the chunk's own rows."""
        length = self.start + self.n
        if window is not None and window >= length:
            window = None  # hides nothing
        if self.start == 0 and self.limit is None and window is None:
            return None
        if window not in self.masks:
            positions = torch.arange(self.start, length)
            limit = positions + 1 if self.limit is None else self.limit
            self.masks[window] = visible(positions, limit, length, window).to(device)
        return self.masks[window]


@dataclass
class GatheredDecode:
    """`TorchAttention`'s decode rows: their blocks gathered into one padded, masked batch."""
    rows: torch.Tensor          # [B] batch rows of the decode tokens
    mask: torch.Tensor          # [B, 1, 1, L] which of the L gathered tokens each sees
    block_ids: torch.Tensor     # [B * blocks] the blocks to gather, B block tables padded to one length
    lengths: torch.Tensor | None = None  # [B] tokens each row attends to (its own included)
    masks: dict = field(default_factory=dict)  # `mask` by sliding window, built once per step

    def windowed(self, window: int | None) -> tuple[torch.Tensor, int]:
        """`mask` less the tokens `window` or more positions before each row's own, from the first
        token some row sees on; and that token's index."""
        if window is None:
            return self.mask, 0
        if window not in self.masks:
            t = torch.arange(self.mask.shape[-1], device=self.mask.device)
            lengths = self.lengths.to(t.device)
            first = max(0, int((lengths - window).min()))
            self.masks[window] = (self.mask & (t >= lengths[:, None] - window)[:, None, None, :])[..., first:], first
        return self.masks[window]


@dataclass
class PagedDecode:
    """The decode rows of a kernel that reads the blocks in place (`triton_vlm.llm.attention.cuda`)."""
    rows: torch.Tensor | None   # [B] batch rows of the decode tokens; None: every row of the batch, in order
    block_tables: torch.Tensor  # [B, max_blocks] int32, each row's block table (padded with any block id)
    context_lens: torch.Tensor  # [B] int32, tokens each row attends to (its own included)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                        # [T] where each row's K/V go
    prefills: Any                                     # the backend's (`TorchAttention`: list[PrefillMeta])
    decode: GatheredDecode | PagedDecode | None       # None: no decode rows in the step


def block_tables(decode: list[SeqRows], block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Host tensors of decode rows (each decoding its token `start`): their block tables
    [rows, blocks of the longest], padded with block 0, and their context lengths [rows] (`dtype`)."""
    lengths = [s.start + 1 for s in decode]
    table = torch.zeros(len(decode), -(-max(lengths) // block_size), dtype=dtype)
    for j, (s, n) in enumerate(zip(decode, lengths)):
        used = s.blocks[:-(-n // block_size)]
        table[j, :len(used)] = torch.tensor(used, dtype=dtype)
    return table, torch.tensor(lengths, dtype=dtype)


def decode_rows(decode: list[SeqRows]) -> torch.Tensor:
    """The batch rows of decode rows (host, long)."""
    return torch.tensor([s.row for s in decode], dtype=torch.long)


class AttentionBackend(Protocol):
    """What the model runner and the model's attention layers need of a backend."""

    def build(self, seqs: list[SeqRows]) -> Any:
        """The step's metadata, once per step, before the forward pass."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        """Write this layer's new K/V into the paged cache; the attention output [T, heads, d]."""


class TorchAttention:
    def __init__(self, config, kv: KVCache):
        self.kv = kv
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = config.scale
        # per attention layer (its K/V index): its sliding window, None for full attention
        self.windows: tuple[int | None, ...] = config.kv_windows
        # where decode K and V are gathered, reused by every layer and step (grown on demand): a fresh
        # tensor per layer costs page faults on the CPU at every step
        self._gathered = kv.k.new_empty(0, 0), kv.v.new_empty(0, 0)

    def _gather(self, k_layer: torch.Tensor, v_layer: torch.Tensor, block_ids: torch.Tensor):
        """The blocks `block_ids` of one layer's K and V, as [len(block_ids), block_size * kv_heads * d] rows."""
        rows, width = block_ids.numel(), self.kv.block_size * self.num_kv_heads * self.head_dim
        if self._gathered[0].shape[0] < rows:
            self._gathered = tuple(t.new_empty(rows + rows // 4, width) for t in (k_layer, v_layer))
        return [torch.index_select(cache.view(self.kv.num_blocks, width), 0, block_ids, out=buf[:rows])
                for cache, buf in zip((k_layer, v_layer), self._gathered)]

    def build(self, seqs: list[SeqRows]) -> AttentionMetadata:
        decode = [s for s in seqs if s.n == 1]
        return AttentionMetadata(self.slot_mapping(seqs), self.prefill_metadata([s for s in seqs if s.n > 1]),
                                 self.decode_metadata(decode) if decode else None)

    def slot_mapping(self, seqs: list[SeqRows]) -> torch.Tensor:
        """Where each row of the step writes its K/V: [T] long, on the cache's device."""
        bs, slots = self.kv.block_size, []
        for s in seqs:
            if s.n == 1:
                slots.append(s.blocks[s.start // bs] * bs + s.start % bs)
            else:
                slots.extend(token_slots(s.blocks, s.start + s.n, bs)[s.start:].tolist())
        return torch.tensor(slots, dtype=torch.long).to(self.kv.k.device)

    def prefill_metadata(self, chunks: list[SeqRows]) -> list[PrefillMeta]:
        device = self.kv.k.device
        prefills = []
        for s in chunks:
            slots = token_slots(s.blocks, s.start + s.n, self.kv.block_size).to(device) if s.start else None
            prefills.append(PrefillMeta(s.row, s.n, s.start, slots, row_limits(s)))
        return prefills

    def decode_metadata(self, decode: list[SeqRows]) -> GatheredDecode:
        device = self.kv.k.device
        # gather whole blocks (block tables), not single slots: block_size x fewer indices
        table, lengths = block_tables(decode, self.kv.block_size, torch.long)
        # as long as the longest context, not its last block: one sequence alone attends over exactly
        # its tokens (SDPA's reduction, and so its rounding, is that of an unpaged cache)
        mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None])[:, None, None, :]
        return GatheredDecode(decode_rows(decode).to(device), mask.to(device), table.reshape(-1).to(device),
                              lengths.to(device))

    def decode(self, layer: int, q: torch.Tensor, meta: GatheredDecode) -> torch.Tensor:
        """The decode rows' attention: queries q [B, heads, d] over their blocks -> [B, heads, d]."""
        B, H, KVH, d = q.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        L = meta.mask.shape[-1]
        # with a sliding window, from the first token any row sees: one sequence alone attends over
        # exactly its window (as a sliding cache holds it)
        mask, first = meta.windowed(self.windows[layer])
        kd, vd = (t.view(B, -1, KVH, d)[:, first:L].transpose(1, 2)
                  for t in self._gather(self.kv.k[layer], self.kv.v[layer], meta.block_ids))
        o = F.scaled_dot_product_attention(q.view(B, KVH, H // KVH, d), kd, vd, attn_mask=mask, scale=self.scale)
        return o.reshape(B, H, d)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, heads, d], k, v [T, kv_heads, d] (rotated) -> attention output [T, heads, d]."""
        T, H, d = q.shape[0], self.num_heads, self.head_dim
        kp, vp = self.kv.k[layer], self.kv.v[layer]
        kp.index_copy_(0, meta.slot_mapping, k)
        vp.index_copy_(0, meta.slot_mapping, v)
        if meta.decode is not None and meta.decode.rows is None:  # every row decodes
            return self.decode(layer, q, meta.decode)
        out = q.new_empty(T, H, d)
        if meta.decode is not None:
            rows = meta.decode.rows
            out.index_copy_(0, rows, self.decode(layer, q.index_select(0, rows), meta.decode))
        self.prefill(layer, q, k, v, meta.prefills, out)
        return out

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefills: Any,
                out: torch.Tensor) -> None:
        """The prompt chunks' attention into their rows of `out` (SDPA per chunk: on its own rows, or
        over its gathered cached prefix and its rows with a mask)."""
        H, KVH = self.num_heads, self.num_kv_heads
        kp, vp = self.kv.k[layer], self.kv.v[layer]
        for p in prefills:
            a, n = p.row, p.n
            if p.slots is not None:
                keys, values = kp.index_select(0, p.slots).transpose(0, 1), vp.index_select(0, p.slots).transpose(0, 1)
            else:
                keys, values = k[a:a + n].transpose(0, 1), v[a:a + n].transpose(0, 1)
            mask = p.mask(self.windows[layer], q.device)
            o = F.scaled_dot_product_attention(q[a:a + n].transpose(0, 1)[None], keys[None], values[None],
                                               attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                               enable_gqa=KVH != H)
            out[a:a + n] = o[0].transpose(0, 1)
