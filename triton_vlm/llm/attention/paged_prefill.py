"""Prefill attention over the paged cache in place: one Triton-language kernel for every prompt
chunk of a step, whatever part of its sequence already lies in the cache (vLLM's `prefix_prefill`,
SGLang's `extend_attention`), with no gathered copy of the context and no explicit mask.

A step's chunk c is `chunk_len[c]` query rows starting at batch row `chunk_row[c]`, its sequence's
tokens `chunk_start[c] ..`; its K/V are already in the cache (the backend writes a step's K/V
before attending), so query i (token `chunk_start + i`) attends to the tokens `0 .. chunk_start + i`
of its block table: the cached part unmasked, the chunk itself causal, one rule (token <= position);
a row inside a bidirectional span (`SeqRows.spans`) sees up to the span's last token instead
(`row_limit`), and on a sliding-window layer only the tokens less than its window before its own.

One program per (query tile, KV head): a tile is `block_q` query rows of one chunk times the G
query heads sharing the KV head, one [block_q * G, d] tile against each K/V tile (GQA without
repeating K/V), walking the context `TOKENS` tokens at a time up to the tile's last position with
flash attention's online softmax (float32 statistics; IEEE dot products in float32, the
probabilities cast to the cache's dtype otherwise, as `paged_decode` does). The tiles of every
chunk of a step are one launch (`PagedPrefill.tile_chunk` / `tile_offset`, built on the host with
the step's metadata). The kernel itself is `triton_vlm.llm.attention.kernels.paged_prefill`.

`PagedPrefillAttention` is the backend (`LLMOptions.paged_prefill`); off, prompt chunks keep SDPA,
until a GPU measures which is faster (`bench/decoder.py --paged-prefill`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from triton_vlm.llm.attention.base import SeqRows, row_limits
from triton_vlm.llm.attention.cuda import TritonAttention, kernel_window
from triton_vlm.llm.layers.cuda_ops import pow2

TOKENS = 32  # context tokens per iteration of the kernel's loop


@dataclass
class PagedPrefill:
    """A step's prompt chunks for `paged_prefill_attention` (device tensors, int32)."""
    block_tables: torch.Tensor  # [C, max_blocks] each chunk's sequence's block table (padded with block 0)
    chunk_row: torch.Tensor     # [C] batch row of each chunk's first query
    chunk_len: torch.Tensor     # [C] query rows of each chunk
    chunk_start: torch.Tensor   # [C] token index (position in its sequence) of each chunk's first query
    tile_chunk: torch.Tensor    # [tiles] the chunk of each query tile
    tile_offset: torch.Tensor   # [tiles] the tile's first query row within its chunk
    row_limit: torch.Tensor     # [rows] per batch row of a chunk: one past the last token it sees (`row_limits`)


def prefill_metadata(chunks: list[SeqRows], block_size: int, block_q: int, device: torch.device) -> PagedPrefill:
    """The chunks' kernel metadata, built on the host and moved once."""
    blocks = [-(-(s.start + s.n) // block_size) for s in chunks]
    tables = torch.zeros(len(chunks), max(blocks), dtype=torch.int32)
    for c, (s, nb) in enumerate(zip(chunks, blocks)):
        tables[c, :nb] = torch.tensor(s.blocks[:nb], dtype=torch.int32)
    tiles = [(c, offset) for c, s in enumerate(chunks) for offset in range(0, s.n, block_q)]
    columns = [[s.row for s in chunks], [s.n for s in chunks], [s.start for s in chunks],
               [c for c, _ in tiles], [o for _, o in tiles]]
    row, n, start, tile_chunk, tile_offset = (torch.tensor(v, dtype=torch.int32).to(device) for v in columns)
    limit = torch.zeros(max(s.row + s.n for s in chunks), dtype=torch.int32)
    for s in chunks:
        spans = row_limits(s)
        limit[s.row:s.row + s.n] = torch.arange(s.start + 1, s.start + s.n + 1) if spans is None else spans
    return PagedPrefill(tables.to(device), row, n, start, tile_chunk, tile_offset, limit.to(device))


def tile_rows(heads: int, kv_heads: int, block_m: int = 64) -> int:
    """Query rows (tokens) per tile: `block_m` rows of the [rows * G, d] tile over the G padded query heads."""
    return max(1, block_m // pow2(heads // kv_heads))


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedPrefill,
                            block_size: int, scale: float, out: torch.Tensor, block_q: int,
                            window: int | None = None) -> None:
    """Write into `out` [T, heads, d] the attention of every chunk row of `meta` (the step's q
    [T, heads, d]) over its sequence's tokens up to its own in the paged cache k_cache, v_cache
    [slots, kv_heads, d] (one layer of `KVCache`, the chunks' K/V already written); `block_q`:
    `tile_rows`, as `meta`'s tiles were cut; `window`: a sliding-window layer's (None: full attention).
    Other rows of `out` are left as they are."""
    T, H, D = q.shape
    KVH = k_cache.shape[1]
    tiles = meta.tile_chunk.shape[0]
    if tiles == 0:
        return
    if q.stride(2) != 1:
        q = q.contiguous()
    from triton_vlm.llm.attention.kernels import paged_prefill

    G = H // KVH
    paged_prefill[(tiles, KVH)](
        q, k_cache, v_cache, out, meta.block_tables, meta.chunk_row, meta.chunk_len, meta.chunk_start,
        meta.tile_chunk, meta.tile_offset, meta.row_limit, scale, kernel_window(window), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        G=G, G_PAD=pow2(G), BLOCK_Q=block_q, D=D, D_PAD=pow2(D, 16), BLOCK_SIZE=block_size, TOKENS=TOKENS,
        IEEE=q.dtype == torch.float32, num_warps=4)


class PagedPrefillAttention(TritonAttention):
    """`TritonAttention` with every prompt chunk of a step through one `paged_prefill_attention`
    launch (CUDA; on the CPU under Triton's interpreter)."""

    def __init__(self, config, kv) -> None:
        super().__init__(config, kv)
        self.block_q = tile_rows(self.num_heads, self.num_kv_heads)

    def prefill_metadata(self, chunks: list[SeqRows]) -> PagedPrefill | None:
        return prefill_metadata(chunks, self.kv.block_size, self.block_q, self.kv.k.device) if chunks else None

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefills: PagedPrefill | None,
                out: torch.Tensor) -> None:
        if prefills is not None:
            paged_prefill_attention(q, self.kv.k[layer], self.kv.v[layer], prefills, self.kv.block_size, self.scale,
                                    out, self.block_q, self.windows[layer])
