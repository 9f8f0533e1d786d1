"""Gated DeltaNet linear attention: the `linear_attention` layers of the Qwen3.5 hybrid text stack
(`Qwen3_5GatedDeltaNet` in transformers' `modeling_qwen3_5`).

Per layer and sequence the mixer carries two states instead of K/V for every token: the last
`conv_kernel - 1` inputs of its causal depthwise conv1d, and the delta-rule state
[v_heads, k_head_dim, v_head_dim]. Both live in the runner's `StateCache` (`triton_vlm.llm.attention.cache`), one
slot per running sequence, carried across prefill chunks and decode steps.

The math follows transformers' torch fallbacks (`causal_conv1d_fn` / `causal_conv1d_update`,
`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`): prefill chunks use the
chunked form (per sequence, from its state), decode rows the one-step recurrent form, batched over
all decoding sequences.

Dtypes, as those fallbacks have them whatever the model's dtype: projections, the conv and its
state, SiLU and the out-projection run in the model's dtype; the decay `g` is float32 (A_log
upcast before exp, `a` upcast before dt_bias is added); the delta rule computes in float32 (q, k,
v, g, beta upcast, q and k L2-normalized there), keeps its recurrent state in float32
(`STATE_DTYPE`) and casts its output back; the gated RMSNorm normalizes in float32, scales by its
weight in the model's dtype and gates by SiLU(z) in float32 before the cast back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

_CHUNK = 64  # the chunked form's block length (transformers' default)
STATE_DTYPE = torch.float32  # the delta-rule state, in every model dtype (StateCache.recurrent)


@dataclass(frozen=True)
class LinearAttentionConfig:
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return self.conv_dim, self.conv_kernel - 1

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return self.num_v_heads, self.k_head_dim, self.v_head_dim


@dataclass
class RecurrentRows:
    """Where each sequence's rows are in a pass and which state slot each one owns. `decode_rows` /
    `decode_slots`: single-row chunks (one recurrent step each, batched); `prefill`: (first row,
    row count, slot) of every longer chunk."""
    decode_rows: torch.Tensor
    decode_slots: torch.Tensor
    prefill: list[tuple[int, int, int]]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's rows: q, k [H, n, dk] (normalized, q scaled), v [H, n, dv], g, beta [H, n],
    state [H, dk, dv] -> (out [H, n, dv], new state). transformers' `torch_chunk_gated_delta_rule`."""
    H, n = k.shape[:2]
    dv = v.shape[-1]
    pad = (_CHUNK - n % _CHUNK) % _CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    nc = (n + pad) // _CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(H, nc, _CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(H, nc, _CHUNK).cumsum(-1)
    upper = torch.ones(_CHUNK, _CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.empty(H, nc, _CHUNK, dv, dtype=v.dtype, device=v.device)
    for i in range(nc):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, -1, dv)[:, :n], state


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state [B, H, dk, dv]
    -> (out [B, H, dv], new state). transformers' `torch_recurrent_gated_delta_rule`, one step."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(-2)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


class GatedDeltaNet:
    """The token mixer of one linear-attention layer: in-projections (one fused matmul), causal
    conv1d + SiLU, the gated delta rule, gated RMSNorm, out-projection."""

    def __init__(self, w: Callable[[str], torch.Tensor], lin: LinearAttentionConfig, eps: float):
        self.lin, self.eps = lin, eps
        self.w_in = torch.cat([w(f"linear_attn.in_proj_{p}.weight") for p in ("qkv", "z", "b", "a")])
        self._split = (lin.conv_dim, lin.value_dim, lin.num_v_heads, lin.num_v_heads)
        self.w_conv = w("linear_attn.conv1d.weight").reshape(lin.conv_dim, lin.conv_kernel)
        self.neg_a = -w("linear_attn.A_log").float().exp()
        self.dt_bias = w("linear_attn.dt_bias")
        self.w_norm = w("linear_attn.norm.weight")
        self.w_out = w("linear_attn.out_proj.weight")

    def _conv(self, x: torch.Tensor, rows: RecurrentRows, conv_state: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv1d + SiLU of x [T, conv_dim], each sequence from its state (updated)."""
        out = torch.empty_like(x)
        kernel = self.lin.conv_kernel
        if rows.decode_rows.numel():
            window = torch.cat([conv_state.index_select(0, rows.decode_slots),
                                x.index_select(0, rows.decode_rows)[..., None]], dim=-1)  # [B, C, K]
            out.index_copy_(0, rows.decode_rows,
                            F.conv1d(window, self.w_conv[:, None], groups=self.lin.conv_dim)[..., 0])
            conv_state.index_copy_(0, rows.decode_slots, window[..., 1:])
        for a, n, slot in rows.prefill:
            full = torch.cat([conv_state[slot], x[a:a + n].t()], dim=-1)  # [C, K - 1 + n]
            out[a:a + n] = F.conv1d(full[None], self.w_conv[:, None], groups=self.lin.conv_dim)[0].t()
            conv_state[slot] = full[:, full.shape[1] - (kernel - 1):]
        return F.silu(out)

    def __call__(self, x: torch.Tensor, rows: RecurrentRows, conv_state: torch.Tensor,
                 rec: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (normed) -> the mixer output [T, hidden]. conv_state [slots, conv_dim,
        kernel - 1] and rec [slots, v_heads, dk, dv] (this layer's states) are updated in place."""
        lin, T = self.lin, x.shape[0]
        mixed, z, b, a = F.linear(x, self.w_in).split(self._split, dim=-1)
        mixed = self._conv(mixed, rows, conv_state)
        q, k, v = mixed.float().split((lin.key_dim, lin.key_dim, lin.value_dim), dim=-1)
        q = _l2norm(q.reshape(T, lin.num_k_heads, lin.k_head_dim)) * lin.k_head_dim ** -0.5
        k = _l2norm(k.reshape(T, lin.num_k_heads, lin.k_head_dim))
        if lin.num_v_heads != lin.num_k_heads:
            rep = lin.num_v_heads // lin.num_k_heads
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        v = v.reshape(T, lin.num_v_heads, lin.v_head_dim)
        beta = b.sigmoid().float()
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)
        core = torch.empty(T, lin.num_v_heads, lin.v_head_dim, dtype=x.dtype, device=x.device)
        if rows.decode_rows.numel():
            r, s = rows.decode_rows, rows.decode_slots
            out, new = recurrent_gated_delta_step(q[r], k[r], v[r], g[r], beta[r], rec.index_select(0, s))
            core.index_copy_(0, r, out.to(x.dtype))
            rec.index_copy_(0, s, new)
        for a0, n, slot in rows.prefill:
            sl = slice(a0, a0 + n)
            out, rec[slot] = chunk_gated_delta_rule(q[sl].transpose(0, 1), k[sl].transpose(0, 1),
                                                    v[sl].transpose(0, 1), g[sl].t(), beta[sl].t(), rec[slot])
            core[sl] = out.transpose(0, 1)
        # gated RMSNorm per value head (plain weight, not 1 + weight), then SiLU(z) gate
        cf = core.float()
        normed = (cf * torch.rsqrt(cf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        gated = self.w_norm * normed * F.silu(z.reshape(T, lin.num_v_heads, lin.v_head_dim).float())
        return F.linear(gated.to(x.dtype).reshape(T, lin.value_dim), self.w_out)
