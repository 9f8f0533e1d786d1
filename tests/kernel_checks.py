"""The llm's Triton-language kernels against their torch references, on any device: full sizes on
CUDA (tests/test_llm_cuda.py, `-m gpu`), small ones on the CPU under Triton's interpreter
(tests/test_kernels_interpret.py, in `make test`)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from triton_vlm.llm.attention.base import SeqRows, TorchAttention, block_tables
from triton_vlm.llm.attention.cache import KVCache


def paged(lengths: list[int], block_size: int, num_blocks: int) -> list[SeqRows]:
    """One decode row per length (its token `length - 1`), blocks taken from a shuffled pool."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    seqs, taken = [], 0
    for row, n in enumerate(lengths):
        nb = -(-n // block_size)
        seqs.append(SeqRows(row, 1, n - 1, order[taken:taken + nb]))
        taken += nb
    return seqs


def attention_config(heads: int, kv_heads: int, head_dim: int, window: int | None = None) -> SimpleNamespace:
    """What the attention backends read of a `DecoderConfig`: one layer, full or of a sliding `window`."""
    return SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=head_dim ** -0.5,
                           kv_windows=(window,))


def check_paged_decode(device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                       lengths: list[int], block_size: int, num_blocks: int, splits: int | None = None,
                       window: int | None = None) -> None:
    """The paged decode kernel (its context split over `splits` programs, default `num_splits`; the
    last `window` tokens of each row with a sliding window) against the gathered-SDPA backend. In float32 within 1e-5 (IEEE dot products); in half precision
    its error against a float64 computation from the same inputs is at most twice SDPA's own in that
    dtype (or one ulp of the largest output)."""
    from triton_vlm.llm.attention.cuda import paged_decode_attention

    torch.manual_seed(0)
    config = attention_config(heads, kv_heads, head_dim, window)
    seqs = paged(lengths, block_size, num_blocks)
    kv = KVCache(1, kv_heads, head_dim, num_blocks, block_size, dtype, device)
    kv.k.normal_(), kv.v.normal_()
    q = torch.randn(len(seqs), heads, head_dim, device=device, dtype=dtype)

    def reference(kv: KVCache, q: torch.Tensor) -> torch.Tensor:
        attention = TorchAttention(config, kv)
        return attention.decode(0, q, attention.decode_metadata(seqs)).double()

    tables, context_lens = (t.to(device) for t in block_tables(seqs, block_size, torch.int32))
    ours = paged_decode_attention(q, kv.k[0], kv.v[0], tables, context_lens, block_size, head_dim ** -0.5,
                                  splits=splits, window=window).double()
    ref = reference(kv, q)
    if dtype == torch.float32:
        assert float((ours - ref).abs().max()) <= 1e-5
        return
    exact_kv = KVCache(1, kv_heads, head_dim, num_blocks, block_size, torch.float64, device)
    exact_kv.k.copy_(kv.k), exact_kv.v.copy_(kv.v)
    exact = reference(exact_kv, q.double())
    ulp = torch.finfo(dtype).eps * float(exact.abs().max())
    ours_err, ref_err = float((ours - exact).abs().max()), float((ref - exact).abs().max())
    assert ours_err <= max(2 * ref_err, ulp), (ours_err, ref_err)


def step(spans: list[tuple], block_size: int, num_blocks: int) -> list[SeqRows]:
    """A step's rows: one sequence per (start, n[, bidirectional spans]), its tokens start .. start + n
    (n == 1: a decode row), rows one sequence after another, blocks taken from a shuffled pool."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    seqs, row, taken = [], 0, 0
    for start, n, *bidirectional in spans:
        nb = -(-(start + n) // block_size)
        seqs.append(SeqRows(row, n, start, order[taken:taken + nb], tuple(bidirectional)))
        row, taken = row + n, taken + nb
    return seqs


def check_attention_step(device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                         spans: list[tuple], block_size: int, num_blocks: int, window: int | None = None) -> None:
    """`PagedPrefillAttention` (every prompt chunk through the paged prefill kernel, decode rows through
    the paged decode kernel; with a sliding `window`, and chunks with bidirectional spans) against
    `TorchAttention` on one step: each writes the step's K/V into its own
    copy of a cache that holds every sequence's earlier tokens, then attends. In float32 within 1e-5;
    in half precision its error against a float64 computation is at most twice SDPA's own in that
    dtype (or one ulp of the largest output)."""
    from triton_vlm.llm.attention.paged_prefill import PagedPrefillAttention

    torch.manual_seed(0)
    config = attention_config(heads, kv_heads, head_dim, window)
    seqs = step(spans, block_size, num_blocks)
    rows = sum(s[1] for s in spans)
    cache = KVCache(1, kv_heads, head_dim, num_blocks, block_size, dtype, device)
    cache.k.normal_(), cache.v.normal_()
    q = torch.randn(rows, heads, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(rows, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))

    def run(backend, dtype: torch.dtype) -> torch.Tensor:
        kv = KVCache(1, kv_heads, head_dim, num_blocks, block_size, dtype, device)
        kv.k.copy_(cache.k), kv.v.copy_(cache.v)
        attention = backend(config, kv)
        return attention.forward(0, q.to(dtype), k.to(dtype), v.to(dtype), attention.build(seqs)).double()

    ours, ref = run(PagedPrefillAttention, dtype), run(TorchAttention, dtype)
    if dtype == torch.float32:
        assert float((ours - ref).abs().max()) <= 1e-5
        return
    exact = run(TorchAttention, torch.float64)
    ulp = torch.finfo(dtype).eps * float(exact.abs().max())
    ours_err, ref_err = float((ours - exact).abs().max()), float((ref - exact).abs().max())
    assert ours_err <= max(2 * ref_err, ulp), (ours_err, ref_err)


def check_rotary(device: str, dtype: torch.dtype, pairing: str, head_dim: int, rotary_dim: int, tokens: int) -> None:
    """Within one ulp of torch's ops: the kernel rounds each product and their sum to the dtype
    where torch does, but Triton may contract a product and a sum into one fused multiply-add
    (measured on an H100: about 1 element in 3 differs by one ulp in float32). q is a view into a
    fused q/k/v output (strided rows), as the model passes it."""
    from triton_vlm.llm.layers import cuda_ops
    from triton_vlm.llm.layers.rotary import HalfPairs, InterleavedPairs, Rotary

    pairs = {"half": HalfPairs, "interleaved": InterleavedPairs}[pairing]
    config = SimpleNamespace(rotary_dim=rotary_dim, head_dim=head_dim, mrope_section=(rotary_dim // 2, 0, 0),
                             mrope_interleaved=False, rope_theta=1e6, longrope=None)
    rope = Rotary(config, pairs, torch.device(device), dtype)
    positions = torch.randint(0, 5000, (3, tokens), device=device)
    cos, sin = (t[:, None] for t in rope.cos_sin(positions))
    fused = torch.randn(tokens, 6 * head_dim, device=device, dtype=dtype)
    q = fused[:, :4 * head_dim].view(tokens, 4, head_dim)
    ours, ref = cuda_ops.rotary(q, cos, sin, pairs.interleaved).float(), rope.apply_torch(q, cos, sin).float()
    assert float((ours - ref).abs().max()) <= torch.finfo(dtype).eps * float(ref.abs().max())


def check_rms_norm(device: str, dtype: torch.dtype, weight_f32: bool, shape: tuple[int, ...]) -> None:
    """In half precision within one ulp of torch's ops and equal almost everywhere: only the order of
    the float32 sum of squares differs, and the cast to the dtype hides it. In float32 nothing hides
    it, and Triton's rsqrt is the fast approximate one on CUDA: within 8 ulps (measured: 4)."""
    from triton_vlm.llm.layers import cuda_ops
    from triton_vlm.llm.layers.decoder import rms_torch

    x = torch.randn(shape, device=device, dtype=dtype) * 3
    weight = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(torch.float32 if weight_f32 else dtype)
    ours, ref = cuda_ops.rms_norm(x, weight, 1e-6).float(), rms_torch(x, weight, 1e-6).float()
    ulps = 8 if dtype == torch.float32 else 1
    assert float((ours - ref).abs().max()) <= ulps * torch.finfo(dtype).eps * float(ref.abs().max())
    if dtype != torch.float32:
        assert float((ours == ref).float().mean()) >= 0.99
