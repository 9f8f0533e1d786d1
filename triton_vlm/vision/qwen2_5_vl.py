"""Qwen2.5-VL vision tower: an export-friendly re-implementation plus its host-side metadata.

The tower keeps patches in the processor's order (frame, merge-block row, merge-block column,
then the 2x2 patches of a merge block), so the 2x2 merge units the merger needs are always
adjacent and no global window permutation is needed. Attention is done in groups: every window
(window-attention blocks) or every frame (full-attention blocks, i.e. `cu_seqlens`) is one group.
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

Every size comes from the checkpoint's vision config.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn as nn

from triton_vlm.weights import read_safetensors

FAMILY = "qwen2_5_vl"
# Every temporal grid step is independent (full attention is per frame, windows never cross
# frames, positions repeat per frame), so a runtime may split videos into frames and run items
# of the same spatial size together without changing the result.
FRAMES_INDEPENDENT = True
MASK_VALUE = -1.0e9  # large negative, finite: every group holds at least one real key
RMS_EPS = 1e-6  # fixed in the Hugging Face implementation (not a config field)

# ONNX graph interface (names are the tower's; the runtime feeds them by name).
METADATA_INPUTS = ("rotary_cos", "rotary_sin", "window_index", "window_mask", "window_inverse",
                   "full_index", "full_mask", "full_inverse")
INPUT_NAMES = ("pixel_values",) + METADATA_INPUTS
OUTPUT_NAME = "embeddings"

# The vision-config fields the tower and its metadata read, with Hugging Face's defaults.
_DEFAULTS: dict[str, Any] = dict(
    depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
    in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
    out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31], rope_theta=10000.0,
)


def vision_settings(vision_config: Any) -> dict[str, Any]:
    """Normalise a vision config (HF config object or dict, e.g. `config.json`'s `vision_config`)
    into a plain JSON-able dict of the fields this module uses."""
    if not isinstance(vision_config, Mapping):
        vision_config = vision_config.to_dict() if hasattr(vision_config, "to_dict") else vars(vision_config)
    cfg = dict(vision_config)
    out: dict[str, Any] = {}
    for key, default in _DEFAULTS.items():
        out[key] = cfg.get(key, default)
    if "in_channels" not in cfg and "in_chans" in cfg:  # original Qwen2.5-VL config.json spelling
        out["in_channels"] = cfg["in_chans"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    out["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", _DEFAULTS["rope_theta"])))
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(out[key], (list, tuple)):
            if len(set(out[key])) != 1:
                raise ValueError(f"non-square {key} {out[key]} is not supported")
            out[key] = int(out[key][0])
    out["fullatt_block_indexes"] = [int(i) for i in out["fullatt_block_indexes"]]
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                "spatial_merge_size", "temporal_patch_size", "window_size", "out_hidden_size"):
        out[key] = int(out[key])
    out["head_dim"] = out["hidden_size"] // out["num_heads"]
    out["patch_dim"] = out["in_channels"] * out["temporal_patch_size"] * out["patch_size"] ** 2
    return out


# --------------------------------------------------------------------------------------------
# Host-side metadata (numpy)
# --------------------------------------------------------------------------------------------

def _groups(order: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def _check_grid(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    if len(grid) and ((grid <= 0).any() or (grid[:, 1:] % merge).any()):
        raise ValueError(f"grid_thw rows must be positive with h and w multiples of {merge}: {grid.tolist()}")
    return grid


def num_patches(grid_thw: np.ndarray) -> int:
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return int(grid.prod(axis=1).sum())


def num_tokens(grid_thw: np.ndarray, vision_config: Any) -> int:
    merge = vision_settings(vision_config)["spatial_merge_size"]
    return num_patches(grid_thw) // (merge * merge)


def _frame_layout(h: int, w: int, m: int, vws: int, inv_freq: np.ndarray):
    """One frame of an h x w patch grid: rotary cos/sin [h*w, head_dim] in processor order, the
    window order of its patches and the (non-empty) window sizes in patches."""
    lh, lw = h // m, w // m
    # Positions in processor order: (bh, bw, i, j) -> (bh*m + i, bw*m + j).
    bh, bw, i, j = np.meshgrid(np.arange(lh), np.arange(lw), np.arange(m), np.arange(m), indexing="ij")
    hpos = (bh * m + i).reshape(-1)
    wpos = (bw * m + j).reshape(-1)
    # Angles as transformers forms them (float32 position * float32 inv_freq), cos/sin rounded once.
    angles = (np.arange(max(h, w), dtype=np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    cos_t, sin_t = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    cos = np.concatenate([cos_t[hpos], cos_t[wpos]], axis=1)
    sin = np.concatenate([sin_t[hpos], sin_t[wpos]], axis=1)
    cos, sin = np.concatenate([cos, cos], axis=1), np.concatenate([sin, sin], axis=1)
    # Windows of vws x vws merge units (ceil division: edge windows are smaller, none empty),
    # row-major inside each window as transformers orders them.
    nww = -(-lw // vws)
    ubh, ubw = np.meshgrid(np.arange(lh), np.arange(lw), indexing="ij")
    window_of_unit = ((ubh // vws) * nww + (ubw // vws)).reshape(-1)
    unit_order = np.argsort(window_of_unit, kind="stable")
    counts = np.bincount(window_of_unit)
    counts = counts[counts > 0].astype(np.int64) * (m * m)
    patch_order = (unit_order[:, None] * (m * m) + np.arange(m * m)[None, :]).reshape(-1).astype(np.int64)
    return cos, sin, patch_order, counts


def encoder_metadata(grid_thw: np.ndarray, vision_config: Any) -> dict[str, np.ndarray]:
    """The tower's metadata inputs for `grid_thw` [M, 3] (processor order), computed with numpy.

    Keys: `METADATA_INPUTS`. Requires at least one item."""
    cfg = vision_config if isinstance(vision_config, dict) and "patch_dim" in vision_config \
        else vision_settings(vision_config)
    m = cfg["spatial_merge_size"]
    vws = cfg["window_size"] // m // cfg["patch_size"]  # window edge in merge units
    if vws <= 0:
        raise ValueError(f"window_size {cfg['window_size']} is smaller than one merge unit")
    grid = _check_grid(grid_thw, m)
    if len(grid) == 0:
        raise ValueError("encoder_metadata needs at least one item")

    head_dim = cfg["head_dim"]
    spatial_dim = head_dim // 2
    inv_freq = (1.0 / (cfg["rope_theta"] ** (np.arange(0, spatial_dim, 2, dtype=np.float64) / spatial_dim))
                ).astype(np.float32)

    cos_parts, sin_parts, win_order, win_sizes, full_sizes = [], [], [], [], []
    per_size: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
    offset = 0  # patch offset of the item
    for t, h, w in grid.tolist():
        if (h, w) not in per_size:
            per_size[(h, w)] = _frame_layout(h, w, m, vws, inv_freq)
        cos, sin, patch_order, counts = per_size[(h, w)]
        cos_parts.append(np.tile(cos, (t, 1)) if t > 1 else cos)
        sin_parts.append(np.tile(sin, (t, 1)) if t > 1 else sin)
        frames = offset + np.arange(t, dtype=np.int64)[:, None] * (h * w)
        win_order.append((frames + patch_order[None, :]).reshape(-1))
        win_sizes.append(np.tile(counts, t))
        full_sizes.append(np.full(t, h * w, dtype=np.int64))
        offset += t * h * w
    cos = np.concatenate(cos_parts)
    sin = np.concatenate(sin_parts)

    w_index, w_mask, w_inv = _groups(np.concatenate(win_order), np.concatenate(win_sizes))
    f_index, f_mask, f_inv = _groups(np.arange(offset, dtype=np.int64), np.concatenate(full_sizes))
    return dict(rotary_cos=cos, rotary_sin=sin, window_index=w_index, window_mask=w_mask,
                window_inverse=w_inv, full_index=f_index, full_mask=f_mask, full_inverse=f_inv)


# --------------------------------------------------------------------------------------------
# Torch tower (parameter names match the Hugging Face state_dict under `visual.`)
# --------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = RMS_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _activation(name: str):
    from transformers.activations import ACT2FN
    return ACT2FN[name]


class _GroupAttention(torch.autograd.Function):
    """Attention inside groups: q, k, v [G, L, dim] (heads packed in dim), additive key mask [G, L]
    and the valid key count per group `lengths` int32 [G] (real keys first). Eager torch uses the
    mask; the ONNX export is one `com.microsoft::MultiHeadAttention` node with `lengths` as its key
    padding mask (ONNX Runtime's fused CPU kernel: no transposes, no separate mask/scale passes)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, lengths, num_heads: int):
        return _group_attention(q, k, v, mask, num_heads)

    @staticmethod
    def symbolic(g, q, k, v, mask, lengths, num_heads):
        from torch.onnx import symbolic_helper
        out = g.op("com.microsoft::MultiHeadAttention", q, k, v,
                   symbolic_helper._optional_input_placeholder_tensor(g), lengths,
                   num_heads_i=num_heads, mask_filter_value_f=MASK_VALUE)
        out.setType(q.type())
        return out


def _group_attention(q, k, v, mask, num_heads: int):
    groups, length, dim = q.shape
    head_dim = dim // num_heads
    dtype = q.dtype
    q = q.reshape(groups, length, num_heads, head_dim).transpose(1, 2)
    k = k.reshape(groups, length, num_heads, head_dim).transpose(1, 2)
    v = v.reshape(groups, length, num_heads, head_dim).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(2, 3)).float() * head_dim ** -0.5 + mask[:, None, None, :]
    probs = torch.softmax(scores, dim=-1).to(dtype)
    return torch.matmul(probs, v).transpose(1, 2).reshape(groups, length, dim)


class VisionAttention(nn.Module):
    # The fused ONNX Runtime attention node is used for float32 exports (ORT's CPU kernel is
    # float32); float16 graphs and eager torch use the plain MatMul / Softmax form.
    fused = True

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)
        self.scaling = self.head_dim ** -0.5

    def forward(self, x, cos, sin, index, mask, inverse, lengths):
        n, dim = x.shape
        groups, length = index.shape
        flat = index.reshape(-1)
        # q and k from one matrix multiply (their rows of the qkv weight), v from another: no
        # split copy of a [N, 3, H, D] result; rotary on q and k together.
        w, b = self.qkv.weight, self.qkv.bias
        qk = nn.functional.linear(x, w[:2 * dim], b[:2 * dim]).reshape(n, 2, self.num_heads, self.head_dim)
        v = nn.functional.linear(x, w[2 * dim:], b[2 * dim:])
        dtype = qk.dtype
        qk = qk.float()
        qk = (qk * cos + _rotate_half(qk) * sin).to(dtype)
        # rows gathered into groups: [G, L, dim] each
        qk = qk.reshape(n, 2 * dim).index_select(0, flat)
        q, k = qk.reshape(groups, length, 2, dim).unbind(2)
        v = v.index_select(0, flat).reshape(groups, length, dim)
        if self.fused and dtype == torch.float32 and torch.onnx.is_in_onnx_export():
            out = _GroupAttention.apply(q, k, v, mask, lengths, self.num_heads)
        else:
            out = _group_attention(q, k, v, mask, self.num_heads)
        out = out.reshape(groups * length, dim).index_select(0, inverse)
        return self.proj(out)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)
        self.act_fn = _activation(act)

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim = cfg["hidden_size"]
        self.norm1 = RMSNorm(dim)
        self.norm2 = RMSNorm(dim)
        self.attn = VisionAttention(dim, cfg["num_heads"])
        self.mlp = VisionMLP(dim, cfg["intermediate_size"], cfg["hidden_act"])

    def forward(self, x, cos, sin, index, mask, inverse, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, index, mask, inverse, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Conv3d with stride == kernel over [N, C*T*P*P] rows is one MatMul."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        k = (cfg["temporal_patch_size"], cfg["patch_size"], cfg["patch_size"])
        self.proj = nn.Conv3d(cfg["in_channels"], cfg["hidden_size"], kernel_size=k, stride=k, bias=False)

    def forward(self, x):
        weight = self.proj.weight.reshape(self.proj.weight.shape[0], -1)
        return torch.matmul(x.to(weight.dtype), weight.t())


class PatchMerger(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        context = cfg["hidden_size"]
        self.hidden = context * cfg["spatial_merge_size"] ** 2
        self.ln_q = RMSNorm(context)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(),
                                 nn.Linear(self.hidden, cfg["out_hidden_size"]))

    def forward(self, x):
        return self.mlp(self.ln_q(x).reshape(-1, self.hidden))


class Qwen2_5_VLVisionTower(nn.Module):
    """Inputs: `pixel_values` [N, patch_dim] plus `METADATA_INPUTS`; output float32 [N / merge^2, out_hidden]."""

    def __init__(self, vision_config: Any):
        super().__init__()
        cfg = vision_settings(vision_config)
        self.settings = cfg
        self.full_blocks = set(cfg["fullatt_block_indexes"])
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg["depth"])])
        self.merger = PatchMerger(cfg)

    def forward(self, pixel_values, rotary_cos, rotary_sin, window_index, window_mask, window_inverse,
                full_index, full_mask, full_inverse):
        x = self.patch_embed(pixel_values)
        cos, sin = rotary_cos.float()[:, None, None, :], rotary_sin.float()[:, None, None, :]
        window_mask, full_mask = window_mask.float(), full_mask.float()
        # Valid keys per group (real keys come first), the fused attention's key padding mask.
        window_len = (window_mask == 0).sum(-1, dtype=torch.int32)
        full_len = (full_mask == 0).sum(-1, dtype=torch.int32)
        for i, block in enumerate(self.blocks):
            if i in self.full_blocks:
                x = block(x, cos, sin, full_index, full_mask, full_inverse, full_len)
            else:
                x = block(x, cos, sin, window_index, window_mask, window_inverse, window_len)
        return self.merger(x).float()


# --------------------------------------------------------------------------------------------
# Checkpoint loading
# --------------------------------------------------------------------------------------------

_PREFIXES = ("model.visual.", "visual.")


def read_vision_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    if "vision_config" not in config:
        raise ValueError(f"{checkpoint_dir}: config.json has no vision_config")
    return vision_settings(config["vision_config"])


def load_state_dict(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The tower's weights (`model.visual.*` or `visual.*`, prefix stripped) from the safetensors,
    reading only those tensors."""
    def strip_prefix(key: str) -> str | None:
        return next((key[len(p):] for p in _PREFIXES if key.startswith(p)), None)

    state = read_safetensors(checkpoint_dir, strip_prefix)
    if not state:
        raise ValueError(f"{checkpoint_dir}: no vision tower weights (prefixes {_PREFIXES})")
    return state


def load_tower(checkpoint_dir: str | Path, dtype: torch.dtype = torch.float32) -> Qwen2_5_VLVisionTower:
    tower = Qwen2_5_VLVisionTower(read_vision_config(checkpoint_dir))
    state = load_state_dict(checkpoint_dir)
    tower.load_state_dict(state, strict=True)
    return tower.to(dtype).eval()


def example_inputs(vision_config: Any, grid_thw=((1, 4, 6), (2, 8, 8))) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Small random inputs for tracing / smoke tests."""
    cfg = vision_settings(vision_config)
    grid = np.asarray(grid_thw, dtype=np.int64)
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((num_patches(grid), cfg["patch_dim"])).astype(np.float32)
    return pixels, encoder_metadata(grid, cfg)


def dynamic_axes() -> dict[str, dict[int, str]]:
    return {
        "pixel_values": {0: "patches"},
        "rotary_cos": {0: "patches"}, "rotary_sin": {0: "patches"},
        "window_index": {0: "windows", 1: "window_len"}, "window_mask": {0: "windows", 1: "window_len"},
        "window_inverse": {0: "patches"},
        "full_index": {0: "frames", 1: "frame_len"}, "full_mask": {0: "frames", 1: "frame_len"},
        "full_inverse": {0: "patches"},
        OUTPUT_NAME: {0: "tokens"},
    }
