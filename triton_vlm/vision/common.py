"""What the vision towers share: host-side group metadata, 2-D rotary tables, the torch layers
(RMSNorm, grouped attention, SwiGLU MLP, pre-norm block, Conv3d patch embedding as one MatMul),
checkpoint reading and the TensorRT profile of the shared inputs.

Attention runs in groups (every frame, as `cu_seqlens`, and for Qwen2.5-VL also every window).
The host computes, with numpy, for each kind of group:

- ``*_index``   int64 [G, L]: patch indices of each group, padded at the end with a real index of
  the same group (never a negative pad value);
- ``*_mask``    float32 [G, L]: additive key mask, 0 for real keys and a large negative (finite)
  value for padding;
- ``*_inverse`` int64 [N]: for each patch, its position in the flattened [G * L] layout.

plus the rotary ``cos`` / ``sin`` per patch [N, head_dim]. Each block gathers q/k/v into
[G, L, dim], attends, and gathers the result back with the inverse index. Padded query rows are
computed and dropped by the inverse gather. No dense N x N mask is ever built. In float32 ONNX
exports the attention is one `com.microsoft::MultiHeadAttention` node (key padding mask = valid
keys per group, derived in the graph from the additive mask); `export.mask_only_when_padded` lets
it drop the mask when no group is padded, and `export.unfuse_attention` turns it back into standard
ops for TensorRT.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import numpy as np
import torch
import torch.nn as nn

from triton_vlm.weights import read_safetensors

MASK_VALUE = -1.0e9  # large negative, finite: every group holds at least one real key
FULL_INPUTS = ("full_index", "full_mask", "full_inverse")
ROTARY_INPUTS = ("rotary_cos", "rotary_sin")


# --------------------------------------------------------------------------------------------
# Vision config
# --------------------------------------------------------------------------------------------

def as_dict(vision_config: Any) -> dict[str, Any]:
    """A vision config (HF config object or dict, e.g. `config.json`'s `vision_config`) as a dict."""
    if not isinstance(vision_config, Mapping):
        vision_config = vision_config.to_dict() if hasattr(vision_config, "to_dict") else vars(vision_config)
    return dict(vision_config)


def config_fields(vision_config: Any, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of `defaults` read from a vision config, plus `rope_theta` wherever the config
    keeps it."""
    cfg = as_dict(vision_config)
    out = {key: cfg.get(key, default) for key, default in defaults.items()}
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    out["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", defaults.get("rope_theta", 10000.0))))
    return out


def square(value: Any, key: str) -> int:
    """An int from a size that may be given per axis (`[14, 14]`); non-square sizes are refused."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"non-square {key} {value} is not supported")
        value = value[0]
    return int(value)


def add_derived(out: dict[str, Any]) -> dict[str, Any]:
    out["head_dim"] = out["hidden_size"] // out["num_heads"]
    out["patch_dim"] = out["in_channels"] * out["temporal_patch_size"] * out["patch_size"] ** 2
    return out


def read_config_json(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's `config.json` (which must have a `vision_config`)."""
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text(encoding="utf-8"))
    if "vision_config" not in config:
        raise ValueError(f"{checkpoint_dir}: config.json has no vision_config")
    return config


# --------------------------------------------------------------------------------------------
# Host-side metadata (numpy)
# --------------------------------------------------------------------------------------------

def groups(order: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group layout for patches `order` (concatenated groups of lengths `sizes`, all > 0).

    Returns gather index [G, L] (padded with the group's last real index), additive key mask
    [G, L] and the inverse index [N] into the flattened [G * L] layout."""
    sizes = sizes.astype(np.int64)
    n_groups = len(sizes)
    length = int(sizes.max())
    starts = np.zeros(n_groups, dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    slot = np.arange(length, dtype=np.int64)
    valid = slot[None, :] < sizes[:, None]
    pos = np.minimum(starts[:, None] + slot[None, :], (starts + sizes - 1)[:, None])
    index = order[pos]
    mask = np.where(valid, np.float32(0.0), np.float32(MASK_VALUE)).astype(np.float32)
    group_of = np.repeat(np.arange(n_groups, dtype=np.int64), sizes)
    flat = group_of * length + (np.arange(len(order), dtype=np.int64) - starts[group_of])
    inverse = np.empty(len(order), dtype=np.int64)
    inverse[order] = flat
    return index, mask, inverse


def frame_groups(grid: np.ndarray) -> dict[str, np.ndarray]:
    """`full_*` metadata: one attention group per frame (`cu_seqlens`)."""
    sizes = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
    index, mask, inverse = groups(np.arange(int(sizes.sum()), dtype=np.int64), sizes)
    return dict(full_index=index, full_mask=mask, full_inverse=inverse)


Layout = TypeVar("Layout")


def item_layouts(grid: np.ndarray, layout: Callable[[int, int], Layout]
                 ) -> list[tuple[int, int, int, int, Layout]]:
    """Per item of `grid`: (t, h, w, its first patch row, `layout(h, w)`). A tower's per-frame
    metadata depends only on the frame's size, so each size is laid out once and every frame of
    every item of that size reuses it."""
    per_size: dict[tuple[int, int], Layout] = {}
    items, offset = [], 0
    for t, h, w in grid.tolist():
        if (h, w) not in per_size:
            per_size[(h, w)] = layout(h, w)
        items.append((t, h, w, offset, per_size[(h, w)]))
        offset += t * h * w
    return items


def check_grid(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """`grid_thw` as int64 [M, 3], M >= 1, h and w multiples of `merge`."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    if len(grid) == 0:
        raise ValueError("encoder_metadata needs at least one item")
    if (grid <= 0).any() or (grid[:, 1:] % merge).any():
        raise ValueError(f"grid_thw rows must be positive with h and w multiples of {merge}: {grid.tolist()}")
    return grid


def num_patches(grid_thw: np.ndarray) -> int:
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return int(grid.prod(axis=1).sum())


def patch_positions(h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of every patch of an h x w grid in processor order: merge block row, merge
    block column, then the m x m patches of the block, i.e. (bh, bw, i, j) -> (bh*m + i, bw*m + j)."""
    bh, bw, i, j = np.meshgrid(np.arange(h // m), np.arange(w // m), np.arange(m), np.arange(m), indexing="ij")
    return (bh * m + i).reshape(-1), (bw * m + j).reshape(-1)


def rotary_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """2-D rotary: each of the two axes rotates a quarter of the head's frequencies."""
    spatial_dim = head_dim // 2
    return (1.0 / (theta ** (np.arange(0, spatial_dim, 2, dtype=np.float64) / spatial_dim))).astype(np.float32)


def rotary_tables(hpos: np.ndarray, wpos: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin [N, head_dim] for patches at (hpos, wpos): `[h-freqs, w-freqs, h-freqs, w-freqs]`,
    angles formed as transformers does (float32 position * float32 inv_freq), rounded once."""
    size = int(max(hpos.max(), wpos.max())) + 1
    angles = (np.arange(size, dtype=np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    cos_t, sin_t = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    cos = np.concatenate([cos_t[hpos], cos_t[wpos]], axis=1)
    sin = np.concatenate([sin_t[hpos], sin_t[wpos]], axis=1)
    return np.concatenate([cos, cos], axis=1), np.concatenate([sin, sin], axis=1)


def example_inputs(settings: dict[str, Any], encoder_metadata, grid_thw) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Random float32 pixel rows for `grid_thw` and their metadata (tracing, smoke tests)."""
    grid = np.asarray(grid_thw, dtype=np.int64)
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((num_patches(grid), settings["patch_dim"])).astype(np.float32)
    return pixels, encoder_metadata(grid, settings)


# ONNX dynamic axes of the rotary and per-frame group inputs (`frame_profile`'s).
FRAME_AXES: dict[str, dict[int, str]] = {
    "rotary_cos": {0: "patches"}, "rotary_sin": {0: "patches"},
    "full_index": {0: "frames", 1: "frame_len"}, "full_mask": {0: "frames", 1: "frame_len"},
    "full_inverse": {0: "patches"},
}


# --------------------------------------------------------------------------------------------
# TensorRT optimisation profile of the shared inputs
# --------------------------------------------------------------------------------------------

Shapes = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def frame_profile(settings: dict[str, Any], patches: tuple[int, int, int]) -> Shapes:
    """(min, opt, max) shapes of `pixel_values`, the rotary tables and the `full_*` inputs for
    engine runs of `patches` = (min, opt, max) patch rows."""
    rotary = per_patch(patches, settings["head_dim"])
    return {"pixel_values": per_patch(patches, settings["patch_dim"]), "rotary_cos": rotary, "rotary_sin": rotary,
            **group_profile("full", patches, settings["spatial_merge_size"] ** 2)}


def group_profile(prefix: str, rows: tuple[int, int, int], min_group: int) -> Shapes:
    """(min, opt, max) shapes of the `<prefix>_index / _mask / _inverse` inputs of one group per
    frame, for runs of `rows` = (min, opt, max) rows of which a frame holds at least `min_group`:
    frames <= rows / min_group, frame length <= rows; opt is one frame of opt rows."""
    _, opt, hi = rows
    frames = ((1, 1), (1, opt), (max(1, hi // min_group), hi))
    return {f"{prefix}_index": frames, f"{prefix}_mask": frames, f"{prefix}_inverse": per_patch(rows)}


def per_patch(patches: tuple[int, int, int], *width: int) -> tuple[tuple[int, ...], ...]:
    """(min, opt, max) shapes of an input with one row per patch."""
    return tuple((p, *width) for p in patches)


# --------------------------------------------------------------------------------------------
# Torch layers (parameter names match the Hugging Face state_dicts)
# --------------------------------------------------------------------------------------------

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
    in every dtype (`residual_stream`)."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str, eps: float, *,
                 qkv_bias: bool, proj_bias: bool, mlp_bias: bool, qk_norm: bool = False):
        super().__init__()
        self.norm1 = RMSNorm(dim, eps)
        self.norm2 = RMSNorm(dim, eps)
        self.attn = VisionAttention(dim, num_heads, qkv_bias, proj_bias, eps if qk_norm else None)
        self.mlp = VisionMLP(dim, mlp_hidden, act, mlp_bias)

    def forward(self, x, cos, sin, index, mask, inverse, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, index, mask, inverse, lengths)
        return x + self.mlp(self.norm2(x))


def residual_stream(x: torch.Tensor) -> torch.Tensor:
    """The embedded patches as the towers' residual stream: float32 whatever the weights' dtype.
    The blocks' attention and MLP outputs (bfloat16 / float16 matrix products) are added in
    float32 and the norms read float32, so rounding does not build up over the depth: with a
    bfloat16 checkpoint, the 7B Qwen2.5-VL tower in bfloat16 is 0.6e-2 off its float32 output
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


# --------------------------------------------------------------------------------------------
# Checkpoint loading
# --------------------------------------------------------------------------------------------

# checkpoint name prefix -> the tower module's name prefix
PREFIXES: dict[str, str] = {"model.visual.": "", "visual.": ""}


def load_state_dict(checkpoint_dir: str | Path, prefixes: Mapping[str, str] = PREFIXES) -> dict[str, torch.Tensor]:
    """The tower's weights from the safetensors, reading only those tensors: keys under a prefix
    of `prefixes` (default `model.visual.*` or `visual.*`), renamed to the tower's prefix."""
    def rename(key: str) -> str | None:
        return next((ours + key[len(p):] for p, ours in prefixes.items() if key.startswith(p)), None)

    state = read_safetensors(checkpoint_dir, rename)
    if not state:
        raise ValueError(f"{checkpoint_dir}: no vision tower weights (prefixes {tuple(prefixes)})")
    return state


def load_strict(tower: nn.Module, checkpoint_dir: str | Path, dtype: torch.dtype,
                prefixes: Mapping[str, str] = PREFIXES) -> nn.Module:
    tower.load_state_dict(load_state_dict(checkpoint_dir, prefixes), strict=True)
    return tower.to(dtype).eval()
