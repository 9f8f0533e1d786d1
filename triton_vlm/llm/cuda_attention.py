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
memory-efficient kernels do). In float32 the dot products run in IEEE float32, not TF32.

Prompt chunks keep `TorchAttention`'s path (SDPA on the contiguous chunk; flash attention on CUDA), or
with `paged_prefill` go through `triton_vlm.llm.paged_prefill.PagedPrefillAttention`. The decode
kernel needs no host sync and fixed-shape inputs only, so decode steps can be captured in CUDA
graphs (`triton_vlm.llm.cuda_graphs`). The module imports Triton when a kernel first runs, never on
the CPU path.
"""
from __future__ import annotations

import functools

import torch

from triton_vlm.llm.attention import PagedDecode, SeqRows, TorchAttention, block_tables, decode_rows
from triton_vlm.llm.cuda_ops import pow2

TOKENS = 64  # context tokens per iteration of the kernel's loop


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, block_tables, context_lens, scale,
                     stride_qb, stride_qh, stride_kslot, stride_khead, stride_ob, stride_oh, stride_bt,
                     G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(context_lens + row)
        # this program's share of the context: whole TOKENS tiles, split by split
        per_split = tl.cdiv(tl.cdiv(length, SPLITS), TOKENS) * TOKENS
        begin = split * per_split
        end = tl.minimum(begin + per_split, length)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        heads = kv_head * G + g
        q_mask = (g < G)[:, None] & (d < D)[None, :]
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        t = tl.arange(0, TOKENS)
        for start in range(begin, end, TOKENS):
            token = start + t
            valid = token < end
            block = tl.load(block_tables + row * stride_bt + token // BLOCK_SIZE, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + token % BLOCK_SIZE
            kv_offsets = slot[:, None] * stride_kslot + kv_head * stride_khead + d[None, :]
            kv_mask = valid[:, None] & (d < D)[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if SPLITS == 1:
            tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            # partials [rows, heads, SPLITS, D + 2]: the unnormalised output, then the max and the sum
            base = part_ptr + ((row * G * tl.num_programs(1) + heads) * SPLITS + split) * (D + 2)
            tl.store(base[:, None] + d[None, :], acc, mask=q_mask)
            tl.store(base + D, m, mask=g < G)
            tl.store(base + D + 1, total, mask=g < G)

    @triton.jit
    def combine(part_ptr, out_ptr, stride_ob, stride_oh, heads,
                D: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr):
        """One (row, head): the splits' partial softmaxes joined (an empty split has max -inf, sum 0)."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        sp = tl.arange(0, SPLITS)
        d = tl.arange(0, D_PAD)
        base = part_ptr + ((row * heads + head) * SPLITS + sp) * (D + 2)
        m = tl.load(base + D)
        total = tl.load(base + D + 1)
        acc = tl.load(base[:, None] + d[None, :], mask=(d < D)[None, :], other=0.0)
        weight = tl.exp(m - tl.max(m, 0))
        out = tl.sum(acc * weight[:, None], 0) / tl.sum(total * weight, 0)
        tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)

    return paged_decode, combine


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
                           splits: int | None = None) -> torch.Tensor:
    """q [B, heads, d] (one query token per row) attending over its row's first `context_lens[row]`
    tokens in the paged cache: k_cache, v_cache [slots, kv_heads, d] (one layer of `KVCache`),
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
    decode, combine = _kernels()
    decode[(B, KVH, splits)](
        q, k_cache, v_cache, out, parts, block_tables, context_lens, scale,
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
                                      self.kv.block_size, self.scale)
