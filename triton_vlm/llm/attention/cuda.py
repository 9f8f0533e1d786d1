"""Paged decode attention on CUDA: a Triton-language kernel that reads each sequence's K/V blocks in
place through its block table (no gathered copy), and the attention backend that uses it.

One program per (decode row, KV head, context split): the G query heads that share the KV head are
one [G, d] tile (GQA without repeating K/V), so a block's K and V are loaded once for all of them.
With few rows the context is split over several programs (flash-decoding: `num_splits`) and a
second kernel joins their partial softmaxes; one sequence would otherwise keep only as many
multiprocessors busy as it has KV heads. A program walks its part of the context `TOKENS` tokens
at a time (a token's slot is `block_tables[row, t // block_size] * block_size + t % block_size`),
with the online softmax of flash attention: scores and the running max / sum / output in float32,
the probabilities cast to the cache's dtype for the product with V (as SDPA's flash and
memory-efficient kernels do). In float32 the dot products run in IEEE float32, not TF32. The kernels
are `triton_vlm.llm.attention.kernels`' `paged_decode` and `combine`.

Prompt chunks keep `TorchAttention`'s path (SDPA on the contiguous chunk; flash attention on CUDA), or
with `paged_prefill` go through `triton_vlm.llm.attention.paged_prefill.PagedPrefillAttention`. The decode
kernel needs no host sync and fixed-shape inputs only, so decode steps can be captured in CUDA
graphs (`triton_vlm.llm.engine.cuda_graphs`). The module imports Triton when a kernel first runs, never on
the CPU path.
"""
from __future__ import annotations

import functools

import torch

from triton_vlm.llm.attention.base import PagedDecode, SeqRows, TorchAttention, block_tables, decode_rows
from triton_vlm.llm.layers.cuda_ops import pow2

TOKENS = 64  # context tokens per iteration of the kernel's loop
# The kernels' window of a full-attention layer: longer than any context (a sliding-window layer
# passes its own, `DecoderConfig.kv_windows`).
NO_WINDOW = 1 << 30


def kernel_window(window: int | None) -> int:
    return NO_WINDOW if window is None else int(window)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors; 1 on the CPU (Triton's interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def num_splits(programs: int, device: torch.device) -> int:
    """Context splits per (row, KV head) so that a step has about two programs per multiprocessor
    (flash-decoding: a few sequences with long contexts would otherwise leave most of the GPU idle);
    a power of two, at most 16. Fixed by the batch shape alone, so a CUDA graph captures it."""
    want = -(-2 * _multiprocessors(device) // programs)
    return min(16, pow2(want)) if want > 1 else 1


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, block_size: int, scale: float,
                           splits: int | None = None, window: int | None = None) -> torch.Tensor:
    """q [B, heads, d] (one query token per row) attending over its row's first `context_lens[row]`
    tokens (the last `window` of them with a sliding window) in the paged cache: k_cache, v_cache [slots, kv_heads, d] (one layer of `KVCache`),
    block_tables [B, max_blocks] int32 -> [B, heads, d] in q's dtype. `splits`: the context splits
    per (row, KV head), `num_splits` by default (CUDA's; the interpreter's tests name theirs)."""
    B, H, D = q.shape
    KVH = k_cache.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    if B == 0:
        return out
    splits = splits or num_splits(B * KVH, q.device)
    parts = torch.empty(B, H, splits, D + 2, dtype=torch.float32, device=q.device) if splits > 1 else out
    from triton_vlm.llm.attention.kernels import combine
    from triton_vlm.llm.attention.kernels import paged_decode as decode

    decode[(B, KVH, splits)](
        q, k_cache, v_cache, out, parts, block_tables, context_lens, scale, kernel_window(window),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        G=H // KVH, G_PAD=pow2(H // KVH, 16), D=D, D_PAD=pow2(D, 16), BLOCK_SIZE=block_size, TOKENS=TOKENS,
        SPLITS=splits, IEEE=q.dtype == torch.float32, num_warps=4)
    if splits > 1:
        combine[(B, H)](parts, out, out.stride(0), out.stride(1), H, D=D, D_PAD=pow2(D, 16), SPLITS=splits,
                        num_warps=1)
    return out


class TritonAttention(TorchAttention):
    """`TorchAttention` with decode rows through `paged_decode_attention` (CUDA)."""

    def decode_metadata(self, decode: list[SeqRows]) -> PagedDecode:
        device = self.kv.k.device
        tables, lengths = block_tables(decode, self.kv.block_size, torch.int32)
        return PagedDecode(decode_rows(decode).to(device), tables.to(device), lengths.to(device))

    def decode(self, layer: int, q: torch.Tensor, meta: PagedDecode) -> torch.Tensor:
        return paged_decode_attention(q, self.kv.k[layer], self.kv.v[layer], meta.block_tables, meta.context_lens,
                                      self.kv.block_size, self.scale, window=self.windows[layer])
