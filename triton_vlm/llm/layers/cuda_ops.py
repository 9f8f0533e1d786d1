"""The decoder's elementwise steps as single Triton-language kernels on CUDA: RMSNorm and the rotary.

In torch each is a chain of small kernels (an RMSNorm is eight: upcast, square, mean, add, rsqrt,
multiply, downcast, scale; a rotary four or five), and in a decode step, where every matrix is a
vector product that streams its weights once, those small launches add up to a sizeable share of
the step. Each kernel here does one row per program and rounds where torch rounds: every
intermediate that torch stores in the model's dtype is cast to it here too, so the results are
torch's except for the order of the RMSNorm's float32 sum of squares (a reordering of float32
additions; after the cast to bfloat16 the two almost always agree). `triton_vlm.llm.model` calls
them for CUDA tensors; the CPU path is torch's ops, unchanged.
"""
from __future__ import annotations

import functools

import torch


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= n (and >= `least`): Triton's block shapes."""
    return max(least, 1 << (n - 1).bit_length())


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm(x_ptr, w_ptr, out_ptr, n, eps, W_F32: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        mask = i < n
        x = tl.load(x_ptr + row * n + i, mask=mask, other=0.0).to(tl.float32)
        normed = x * tl.rsqrt(tl.sum(x * x, 0) / n + eps)
        w = tl.load(w_ptr + i, mask=mask, other=0.0)
        dtype = out_ptr.dtype.element_ty
        if W_F32:  # (normed * weight).to(dtype)
            out = (normed * w).to(dtype)
        else:      # weight * normed.to(dtype)
            out = (w.to(tl.float32) * normed.to(dtype).to(tl.float32)).to(dtype)
        tl.store(out_ptr + row * n + i, out, mask=mask)

    @triton.jit
    def rotary(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, x_stride_t, x_stride_h,
               D: tl.constexpr, R: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):
        """One (token, head) row: dims < R become x * cos + partner(x) * sin (each product rounded
        to the dtype, then their sum), the rest are copied."""
        pid = tl.program_id(0)
        t = pid // heads
        h = pid % heads
        i = tl.arange(0, BLOCK)
        base = x_ptr + t * x_stride_t + h * x_stride_h
        in_head = i < D
        rot = i < R
        x = tl.load(base + i, mask=in_head, other=0.0)
        if INTERLEAVED:
            partner = i ^ 1
        else:
            partner = (i + R // 2) % R
        p = tl.load(base + partner, mask=rot, other=0.0)
        c = tl.load(cos_ptr + t * R + i, mask=rot, other=0.0)
        s = tl.load(sin_ptr + t * R + i, mask=rot, other=0.0)
        dtype = out_ptr.dtype.element_ty
        a = (x.to(tl.float32) * c.to(tl.float32)).to(dtype)
        b = (p.to(tl.float32) * s.to(tl.float32)).to(dtype)
        out = tl.where(rot, (a.to(tl.float32) + b.to(tl.float32)).to(dtype), x)
        tl.store(out_ptr + (t * heads + h) * D + i, out, mask=in_head)

    return rms_norm, rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`triton_vlm.llm.layers.decoder._rms` over the last dim of x (any leading shape), one kernel."""
    x = x.contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // n
    if rows:
        _kernels()[0][(rows,)](x, weight, out, n, eps, W_F32=weight.dtype == torch.float32, BLOCK=pow2(n),
                               num_warps=min(16, max(1, pow2(n) // 256)))
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """`Rotary.apply` for x [T, heads, head_dim] (its last dim contiguous) and cos, sin [T, 1, rotary_dim]."""
    T, heads, D = x.shape
    R = cos.shape[-1]
    out = torch.empty(T, heads, D, dtype=x.dtype, device=x.device)
    if T:
        _kernels()[1][(T * heads,)](x, cos.contiguous(), sin.contiguous(), out, heads, x.stride(0), x.stride(1),
                                    D=D, R=R, INTERLEAVED=interleaved, BLOCK=pow2(D), num_warps=1)
    return out
