"""The Triton-language kernels of paged attention: decode (`paged_decode` and its split `combine`)
and prefill (`paged_prefill`), sharing one step over the paged cache (`attend_tile`).

Imported only when a kernel first runs (`cuda_attention`, `paged_prefill` hold the host side and
say what each kernel computes): importing Triton is not for the CPU path.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(q, k_ptr, v_ptr, table_ptr, first, end, low, high, mx, total, acc, scale, stride_kslot, head_offset,
                d, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, IEEE: tl.constexpr):
    """One step of flash attention's online softmax for the query rows `q` [M, D_PAD] over the
    tokens `first .. first + TOKENS` (those below `end`) of a sequence whose block table starts at
    `table_ptr`: a token's slot is `table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE`, and row m
    sees the tokens `low[m] .. high[m] - 1` (a sliding window's start, the end of its causal or
    bidirectional reach). Returns the running max, sum and unnormalised output; scores and
    statistics in float32, IEEE dot products in float32, the probabilities cast to the cache's dtype
    otherwise (as SDPA's flash and memory-efficient kernels do). A row that has seen no token yet
    keeps max -inf, sum 0 and output 0."""
    token = first + tl.arange(0, TOKENS)
    valid = token < end
    block = tl.load(table_ptr + token // BLOCK_SIZE, mask=valid, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + token % BLOCK_SIZE
    kv_offsets = slot[:, None] * stride_kslot + head_offset + d[None, :]
    kv_mask = valid[:, None] & (d < D)[None, :]
    k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    seen = valid[None, :] & (token[None, :] >= low[:, None]) & (token[None, :] < high[:, None])
    s = tl.where(seen, s * scale, float("-inf"))
    m_new = tl.maximum(mx, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(mx - m_safe)
    p = tl.exp(s - m_safe[:, None])
    total = total * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, total, acc


@triton.jit
def paged_decode(q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, block_tables, context_lens, scale, window,
                 stride_qb, stride_qh, stride_kslot, stride_khead, stride_ob, stride_oh, stride_bt,
                 G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
    """One program per (decode row, KV head, context split): the G query heads of the KV head as one
    [G, d] tile over the split's share of the row's context: its last `window` tokens (a sliding-window
    layer's; `cuda.NO_WINDOW` for full attention)."""
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
    first = tl.maximum(length - window, 0)  # the first token the row sees
    high = tl.full([G_PAD], 0, tl.int32) + length  # the row's own token is the last it sees
    low = tl.full([G_PAD], 0, tl.int32) + first
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(tl.maximum(begin, first // TOKENS * TOKENS), end, TOKENS):
        m, total, acc = attend_tile(q, k_ptr, v_ptr, block_tables + row * stride_bt, start, end, low, high, m, total,
                                    acc, scale, stride_kslot, kv_head * stride_khead, d, D, BLOCK_SIZE, TOKENS, IEEE)
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
def combine(part_ptr, out_ptr, stride_ob, stride_oh, heads, D: tl.constexpr, D_PAD: tl.constexpr,
            SPLITS: tl.constexpr):
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


@triton.jit
def paged_prefill(q_ptr, k_ptr, v_ptr, out_ptr, block_tables, chunk_row, chunk_len, chunk_start,
                  tile_chunk, tile_offset, row_limit, scale, window, stride_qt, stride_qh, stride_kslot, stride_khead,
                  stride_ot, stride_oh, stride_bt,
                  G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, D: tl.constexpr,
                  D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, IEEE: tl.constexpr):
    """One program per (query tile, KV head): `BLOCK_Q` query rows of one chunk times the G query
    heads of the KV head, over the chunk's sequence up to the furthest `row_limit` of its rows (one
    past the last token a batch row sees: its own, or its bidirectional span's last), each row from
    `window` tokens before its own on (a sliding-window layer's; `cuda.NO_WINDOW` for full attention)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.load(tile_chunk + tile)
    offset = tl.load(tile_offset + tile)
    row0 = tl.load(chunk_row + chunk)
    n = tl.load(chunk_len + chunk)
    start = tl.load(chunk_start + chunk)
    # the tile's [BLOCK_Q * G_PAD, D] queries: row m is query offset + m // G_PAD, head m % G_PAD
    m = tl.arange(0, BLOCK_Q * G_PAD)
    qi = offset + m // G_PAD
    g = m % G_PAD
    d = tl.arange(0, D_PAD)
    q_mask = ((qi < n) & (g < G))[:, None] & (d < D)[None, :]
    q_offsets = (row0 + qi).to(tl.int64)[:, None] * stride_qt + (kv_head * G + g)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    position = start + qi  # every row sees its own token at least: no row's softmax is empty
    high = tl.load(row_limit + row0 + qi, mask=qi < n, other=0)
    low = tl.maximum(position - window + 1, 0)
    end = tl.max(high, 0)  # one past the last token any row of the tile sees
    begin = tl.maximum(start + offset - window + 1, 0) // TOKENS * TOKENS
    mx = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    for first in range(begin, end, TOKENS):
        mx, total, acc = attend_tile(q, k_ptr, v_ptr, block_tables + chunk * stride_bt, first, end, low, high, mx,
                                     total, acc, scale, stride_kslot, kv_head * stride_khead, d, D, BLOCK_SIZE,
                                     TOKENS, IEEE)
    out_offsets = (row0 + qi).to(tl.int64)[:, None] * stride_ot + (kv_head * G + g)[:, None] * stride_oh + d[None, :]
    total = tl.where(total == 0, 1.0, total)  # the tile's padding rows (past the chunk) see nothing
    tl.store(out_ptr + out_offsets, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
