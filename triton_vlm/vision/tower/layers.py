"""The torch layers the vision towers share (parameter names match the Hugging Face state_dicts):
RMSNorm and LayerNorm, grouped attention (over `attention_groups`' padded groups, or fused SDPA per
group), the SwiGLU MLP, the pre-norm block, the Conv3d patch embedding as one MatMul, and the
float32 residual stream."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from triton_vlm.vision.tower.attention_groups import MASK_VALUE


class RMSNorm(nn.Module):
    """Normalised in float32, returned in the weight's dtype (the next matrix product's): from the
    float32 residual stream too. With input and weight of one dtype, transformers' RMSNorm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(self.weight.dtype)


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` that also reads the float32 residual stream of a bfloat16 / float16 tower:
    normalised in float32 with the weights upcast, returned in the weights' dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.weight.dtype
        if x.dtype == dtype:
            return super().forward(x)
        return nn.functional.layer_norm(x.float(), self.normalized_shape, self.weight.float(),
                                        self.bias.float(), self.eps).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def activation(name: str):
    from transformers.activations import ACT2FN
    return ACT2FN[name]


class _GroupAttention(torch.autograd.Function):
    """Attention inside groups: q, k, v [G, L, dim] (heads packed in dim), additive key mask [G, L]
    and the valid key count per group `lengths` int32 [G] (real keys first). Eager torch uses the
    mask; the ONNX export is one `com.microsoft::MultiHeadAttention` node with `lengths` as its key
    padding mask (ONNX Runtime's fused CPU kernel: no transposes, no separate mask/scale passes)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, lengths, num_heads: int):
        return group_attention(q, k, v, mask, num_heads)

    @staticmethod
    def symbolic(g, q, k, v, mask, lengths, num_heads):
        from torch.onnx import symbolic_helper
        out = g.op("com.microsoft::MultiHeadAttention", q, k, v,
                   symbolic_helper._optional_input_placeholder_tensor(g), lengths,
                   num_heads_i=num_heads, mask_filter_value_f=MASK_VALUE)
        out.setType(q.type())
        return out


class _FullGroupAttention(torch.autograd.Function):
    """`_GroupAttention` for groups without padding: no mask, the node has q, k, v only."""

    @staticmethod
    def forward(ctx, q, k, v, num_heads: int):
        return group_attention(q, k, v, None, num_heads)

    @staticmethod
    def symbolic(g, q, k, v, num_heads):
        out = g.op("com.microsoft::MultiHeadAttention", q, k, v, num_heads_i=num_heads)
        out.setType(q.type())
        return out


def attention(q, k, v, mask, lengths, num_heads: int, fused: bool):
    """Attention of q, k, v [G, L, dim] inside each group; `mask` / `lengths` None when no group is
    padded. `fused`: float32 ONNX exports emit ONNX Runtime's MultiHeadAttention node. Eager torch
    (the `torch` encoder back end, the tests' towers) runs `sdpa_groups`."""
    if not torch.onnx.is_in_onnx_export():
        return sdpa_groups(q, k, v, None if mask is None else lengths, num_heads)
    if fused and q.dtype == torch.float32:
        if mask is None:
            return _FullGroupAttention.apply(q, k, v, num_heads)
        return _GroupAttention.apply(q, k, v, mask, lengths, num_heads)
    return group_attention(q, k, v, mask, num_heads)


def sdpa_groups(q, k, v, lengths, num_heads: int):
    """`scaled_dot_product_attention` per attention group, unmasked: the groups of each valid key
    count (`lengths`, None: all full) run together cut to that count, so every call has equal,
    unpadded groups and takes the fused kernels (flash attention on CUDA in bfloat16 / float16,
    the CPU flash kernel in float32). No [heads, L, L] score tensor exists in any dtype: a
    16k-patch frame needs only its q, k, v and output, [16384, dim] each. Padded query rows are
    left at zero (the inverse gather drops them)."""
    groups_, length, dim = q.shape

    def attend(sel_q, sel_k, sel_v):
        g, n = sel_q.shape[:2]
        heads = [x.reshape(g, n, num_heads, dim // num_heads).transpose(1, 2) for x in (sel_q, sel_k, sel_v)]
        return nn.functional.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(g, n, dim)

    counts = None if lengths is None else lengths.unique().tolist()
    if counts is None or counts == [length]:
        return attend(q, k, v)
    out = q.new_zeros(groups_, length, dim)
    for n in counts:
        sel = (lengths == n).nonzero().squeeze(1)
        out[sel, :n] = attend(q[sel, :n], k[sel, :n], v[sel, :n])
    return out


def group_attention(q, k, v, mask, num_heads: int):
    """Attention inside each group as the float16 / bfloat16 ONNX exports write it, in TensorRT's
    attention-fusion form: q scaled before the first MatMul, MatMul(q, k^T), the additive key mask,
    Softmax, MatMul(p, v), all in q's dtype (no Cast in the chain). TensorRT fuses that chain into
    its flash-attention kernel, which holds no [heads, L, L] tensor; run unfused, a 16k-patch frame
    at 16 heads would hold 16 x 16384^2 x 2 bytes = 8 GiB of scores (float32 scores: 16 GiB)."""
    groups_, length, dim = q.shape
    head_dim = dim // num_heads
    q, k, v = (x.reshape(groups_, length, num_heads, head_dim).transpose(1, 2) for x in (q, k, v))
    # q scaled in float32: in bfloat16 the TorchScript exporter casts the (traced) scale to ONNX
    # type 15, complex128, torch's own number for bfloat16
    q = (q.float() * head_dim ** -0.5).to(k.dtype)
    scores = torch.matmul(q, k.transpose(2, 3))
    if mask is not None:  # MASK_VALUE is below float16's range: its most negative value instead
        scores = scores + mask.clamp(min=torch.finfo(q.dtype).min).to(q.dtype)[:, None, None, :]
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(1, 2).reshape(groups_, length, dim)


def key_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Valid keys per group (real keys come first): the fused attention's key padding mask."""
    return (mask == 0).sum(-1, dtype=torch.int32)


class VisionAttention(nn.Module):
    # The fused ONNX Runtime attention node is used for float32 exports (ORT's CPU kernel is
    # float32); float16 / bfloat16 graphs use the plain MatMul / Softmax chain (`group_attention`),
    # eager torch fused SDPA (`sdpa_groups`).
    fused = True

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool, proj_bias: bool, qk_norm_eps: float | None = None):
        """`qk_norm_eps`: q and k are RMS-normed per head (`q_norm`, `k_norm`) before the rotary."""
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.qk_norm = qk_norm_eps is not None
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, qk_norm_eps)

    def forward(self, x, cos, sin, index, mask, inverse, lengths):
        n, dim = x.shape
        groups_, length = index.shape
        flat = index.reshape(-1)
        # q and k from one matrix multiply (their rows of the qkv weight), v from another: no
        # split copy of a [N, 3, H, D] result; rotary on q and k together.
        w, b = self.qkv.weight, self.qkv.bias
        qk = nn.functional.linear(x, w[:2 * dim], None if b is None else b[:2 * dim])
        qk = qk.reshape(n, 2, self.num_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.unbind(1)
            qk = torch.stack((self.q_norm(q), self.k_norm(k)), dim=1)
        v = nn.functional.linear(x, w[2 * dim:], None if b is None else b[2 * dim:])
        if cos is not None:  # None: a tower without rotary (positions added at the embedding)
            dtype = qk.dtype
            qk = qk.float()
            qk = (qk * cos + rotate_half(qk) * sin).to(dtype)
        # rows gathered into groups: [G, L, dim] each
        qk = qk.reshape(n, 2 * dim).index_select(0, flat)
        q, k = qk.reshape(groups_, length, 2, dim).unbind(2)
        v = v.index_select(0, flat).reshape(groups_, length, dim)
        out = attention(q, k, v, mask, lengths, self.num_heads, self.fused)
        out = out.reshape(groups_ * length, dim).index_select(0, inverse)
        return self.proj(out)


class VisionMLP(nn.Module):
    """SwiGLU-style: down(act(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, act: str, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act_fn = activation(act)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x)). x is the float32 residual stream
    in every dtype (`residual_stream`). `norm`: the norms' class, `norm(dim, eps)` (RMSNorm or
    LayerNorm); `mlp`: the MLP where it is not the SwiGLU `VisionMLP`."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str, eps: float, *,
                 qkv_bias: bool, proj_bias: bool, mlp_bias: bool, qk_norm: bool = False,
                 norm: type[nn.Module] = RMSNorm, mlp: nn.Module | None = None):
        super().__init__()
        self.norm1 = norm(dim, eps)
        self.norm2 = norm(dim, eps)
        self.attn = VisionAttention(dim, num_heads, qkv_bias, proj_bias, eps if qk_norm else None)
        self.mlp = mlp if mlp is not None else VisionMLP(dim, mlp_hidden, act, mlp_bias)

    def forward(self, x, cos, sin, index, mask, inverse, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, index, mask, inverse, lengths)
        return x + self.mlp(self.norm2(x))


def residual_stream(x: torch.Tensor) -> torch.Tensor:
    """The embedded patches as the towers' residual stream: float32 whatever the weights' dtype.
    The blocks' attention and MLP outputs (bfloat16 / float16 matrix products) are added in
    float32 and the norms read float32, so rounding does not build up over the depth: with a
    bfloat16 checkpoint, a 7B tower in bfloat16 is 0.6e-2 off its float32 output
    instead of transformers' 1.4e-2 (bench/gpu.py). A float32 tower is unchanged."""
    return x.float()


class PatchEmbed(nn.Module):
    """Conv3d with stride == kernel over [N, C*T*P*P] rows is one MatMul."""

    def __init__(self, cfg: dict[str, Any], bias: bool):
        super().__init__()
        k = (cfg["temporal_patch_size"], cfg["patch_size"], cfg["patch_size"])
        self.proj = nn.Conv3d(cfg["in_channels"], cfg["hidden_size"], kernel_size=k, stride=k, bias=bias)

    def forward(self, x):
        return patch_linear(x, self.proj)


def patch_linear(x: torch.Tensor, conv: nn.Module) -> torch.Tensor:
    """A convolution with stride == kernel applied to patch rows [N, C * kernel...] (flattened in
    its weight's order) as one MatMul."""
    weight = conv.weight.reshape(conv.weight.shape[0], -1)
    return nn.functional.linear(x.to(weight.dtype), weight, conv.bias)
