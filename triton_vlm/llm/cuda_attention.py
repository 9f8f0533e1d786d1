"""Paged decode attention on CUDA: a Triton-language kernel that reads each sequence's K/V blocks in
place through its block table (no gathered copy), and the attention backend that uses it.

One program per (decode row, KV head): the G query heads that share the KV head are one [G, d]
tile (GQA without repeating K/V), so a block's K and V are loaded once for all of them. The
program walks the row's context `TOKENS` tokens at a time (a token's slot is
`block_tables[row, t // block_size] * block_size + t % block_size`), with the online softmax of
flash attention: scores and the running max / sum / output in float32, the probabilities cast to
the cache's dtype for the product with V (as SDPA's flash and memory-efficient kernels do). In
float32 the dot products run in IEEE float32, not TF32.

Prefill chunks keep `TorchAttention`'s path (SDPA on the contiguous chunk; flash attention on CUDA).
The kernel needs no host sync and fixed-shape inputs only, so decode steps can be captured in CUDA
graphs (`triton_vlm.llm.cuda_graphs`). The module imports Triton when a kernel first runs, never on
the CPU path.
"""
from __future__ import annotations

import functools

import torch

from triton_vlm.llm.attention import PagedDecode, SeqRows, TorchAttention

TOKENS = 64  # context tokens per iteration of the kernel's loop


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(q_ptr, k_ptr, v_ptr, out_ptr, block_tables, context_lens, scale,
                     stride_qb, stride_qh, stride_kslot, stride_khead, stride_ob, stride_oh, stride_bt,
                     G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, IEEE: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        length = tl.load(context_lens + row)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        q_mask = (g < G)[:, None] & (d < D)[None, :]
        q = tl.load(q_ptr + row * stride_qb + (kv_head * G + g)[:, None] * stride_qh + d[None, :], mask=q_mask,
                    other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        t = tl.arange(0, TOKENS)
        for start in range(0, length, TOKENS):
            token = start + t
            valid = token < length
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
        out = acc / total[:, None]
        tl.store(out_ptr + row * stride_ob + (kv_head * G + g)[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)

    return paged_decode


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """q [B, heads, d] (one query token per row) attending over its row's first `context_lens[row]`
    tokens in the paged cache: k_cache, v_cache [slots, kv_heads, d] (one layer of `KVCache`),
    block_tables [B, max_blocks] int32 -> [B, heads, d] in q's dtype."""
    B, H, D = q.shape
    KVH = k_cache.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    if B == 0:
        return out
    _kernel()[(B, KVH)](
        q, k_cache, v_cache, out, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        G=H // KVH, G_PAD=_pow2(H // KVH, 16), D=D, D_PAD=_pow2(D, 16), BLOCK_SIZE=block_size, TOKENS=TOKENS,
        IEEE=q.dtype == torch.float32, num_warps=4)
    return out


def paged_decode_metadata(decode: list[SeqRows], block_size: int, device: torch.device) -> PagedDecode:
    """The block tables and context lengths of `decode`'s rows (each decoding token `start`)."""
    width = max(-(-(s.start + 1) // block_size) for s in decode)
    tables = torch.zeros(len(decode), width, dtype=torch.int32)
    for j, s in enumerate(decode):
        used = s.blocks[:-(-(s.start + 1) // block_size)]
        tables[j, :len(used)] = torch.tensor(used, dtype=torch.int32)
    lens = torch.tensor([s.start + 1 for s in decode], dtype=torch.int32)
    rows = torch.tensor([s.row for s in decode], dtype=torch.long)
    return PagedDecode(rows.to(device), tables.to(device), lens.to(device))


class TritonAttention(TorchAttention):
    """`TorchAttention` with decode rows through `paged_decode_attention` (CUDA)."""

    def decode_metadata(self, decode: list[SeqRows]) -> PagedDecode:
        return paged_decode_metadata(decode, self.kv.block_size, self.kv.k.device)

    def decode(self, layer: int, q: torch.Tensor, meta: PagedDecode) -> torch.Tensor:
        return paged_decode_attention(q, self.kv.k[layer], self.kv.v[layer], meta.block_tables, meta.context_lens,
                                      self.kv.block_size, self.scale)
