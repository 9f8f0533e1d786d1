"""Qwen2.5-VL vision tower: an export-friendly re-implementation plus its host-side metadata.

The tower keeps patches in the processor's order (frame, merge-block row, merge-block column,
then the 2x2 patches of a merge block), so the 2x2 merge units the merger needs are always
adjacent and no global window permutation is needed. Attention is done in groups (see
`triton_vlm.vision.tower.attention_groups`): every window (window-attention blocks) or every frame
(full-attention blocks, i.e. `cu_seqlens`) is one group, with `window_*` and `full_*` metadata.

Every size comes from the checkpoint's vision config.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch.nn as nn

from triton_vlm.vision.tower import attention_groups
from triton_vlm.vision.tower import config as tower_config
from triton_vlm.vision.tower import layers as tower_layers
from triton_vlm.vision.tower import trt_profile
from triton_vlm.vision.tower.base import Tower

NORM_EPS = 1e-6  # fixed in the Hugging Face implementations, Qwen2-VL's too (not a config field)
METADATA_INPUTS = attention_groups.ROTARY_INPUTS + ("window_index", "window_mask", "window_inverse") + attention_groups.FULL_INPUTS

# The vision-config fields the tower and its metadata read, with Hugging Face's defaults.
_DEFAULTS: dict[str, Any] = dict(
    depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
    in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
    out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31], rope_theta=10000.0,
)


def vision_settings(vision_config: Any) -> dict[str, Any]:
    """Normalise a vision config (HF config object or dict, e.g. `config.json`'s `vision_config`)
    into a plain JSON-able dict of the fields this module uses."""
    cfg = tower_config.as_dict(vision_config)
    out = tower_config.config_fields(cfg, _DEFAULTS)
    if "in_channels" not in cfg and "in_chans" in cfg:  # original Qwen2.5-VL config.json spelling
        out["in_channels"] = cfg["in_chans"]
    for key in ("patch_size", "temporal_patch_size"):
        out[key] = tower_config.square(out[key], key)
    out["fullatt_block_indexes"] = [int(i) for i in out["fullatt_block_indexes"]]
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                "spatial_merge_size", "window_size", "out_hidden_size"):
        out[key] = int(out[key])
    return tower_config.add_derived(out)



# --------------------------------------------------------------------------------------------
# Host-side metadata (numpy)
# --------------------------------------------------------------------------------------------

def _frame_layout(h: int, w: int, m: int, vws: int, inv_freq: np.ndarray):
    """One frame of an h x w patch grid: rotary cos/sin [h*w, head_dim] in processor order, the
    window order of its patches and the (non-empty) window sizes in patches."""
    cos, sin = attention_groups.rotary_tables(*attention_groups.patch_positions(h, w, m), inv_freq)
    lh, lw = h // m, w // m
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


def encoder_metadata(grid_thw: np.ndarray, settings: dict[str, Any]) -> dict[str, np.ndarray]:
    """The tower's metadata inputs for `grid_thw` [M, 3] (processor order), computed with numpy.

    Keys: `METADATA_INPUTS`. Requires at least one item."""
    m = settings["spatial_merge_size"]
    vws = settings["window_size"] // m // settings["patch_size"]  # window edge in merge units
    if vws <= 0:
        raise ValueError(f"window_size {settings['window_size']} is smaller than one merge unit")
    grid = attention_groups.check_grid(grid_thw, m)
    inv_freq = attention_groups.rotary_inv_freq(settings["head_dim"], settings["rope_theta"])

    cos_parts, sin_parts, win_order, win_sizes = [], [], [], []
    items = attention_groups.item_layouts(grid, lambda h, w: _frame_layout(h, w, m, vws, inv_freq))
    for t, h, w, offset, (cos, sin, patch_order, counts) in items:
        cos_parts.append(np.tile(cos, (t, 1)) if t > 1 else cos)
        sin_parts.append(np.tile(sin, (t, 1)) if t > 1 else sin)
        frames = offset + np.arange(t, dtype=np.int64)[:, None] * (h * w)
        win_order.append((frames + patch_order[None, :]).reshape(-1))
        win_sizes.append(np.tile(counts, t))

    w_index, w_mask, w_inv = attention_groups.groups(np.concatenate(win_order), np.concatenate(win_sizes))
    return dict(rotary_cos=np.concatenate(cos_parts), rotary_sin=np.concatenate(sin_parts),
                window_index=w_index, window_mask=w_mask, window_inverse=w_inv, **attention_groups.frame_groups(grid))


def profile_shapes(settings: dict[str, Any], patches: tuple[int, int, int]) -> trt_profile.Shapes:
    """TensorRT (min, opt, max) shape of every input for runs of `patches` (min, opt, max) rows.
    Windows <= patches / merge^2 (a window holds at least one merge unit), window length <= the
    window's area in patches; opt is one square image of opt patches."""
    _, opt, hi = patches
    merge_unit = settings["spatial_merge_size"] ** 2
    window = max(merge_unit, (settings["window_size"] // settings["patch_size"]) ** 2)
    windows = ((1, 1), (max(1, opt // window), min(window, opt)), (max(1, hi // merge_unit), min(window, hi)))
    return {**trt_profile.frame_profile(settings, patches), "window_index": windows, "window_mask": windows,
            "window_inverse": trt_profile.per_patch(patches)}


# --------------------------------------------------------------------------------------------
# Torch tower (parameter names match the Hugging Face state_dict under `visual.`)
# --------------------------------------------------------------------------------------------

class PatchMerger(nn.Module):
    """`ln_q` on each patch (`norm(dim, eps)`: Qwen2.5-VL's RMSNorm, Qwen2-VL's LayerNorm), the
    merge block's patches side by side, Linear, GELU, Linear."""

    def __init__(self, cfg: dict[str, Any], norm: type[nn.Module] = tower_layers.RMSNorm):
        super().__init__()
        context = cfg["hidden_size"]
        self.hidden = context * cfg["spatial_merge_size"] ** 2
        self.ln_q = norm(context, NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(),
                                 nn.Linear(self.hidden, cfg["out_hidden_size"]))

    def forward(self, x):
        return self.mlp(self.ln_q(x).reshape(-1, self.hidden))


class Qwen2_5_VLVisionTower(nn.Module):
    """Inputs: `pixel_values` [N, patch_dim] plus `METADATA_INPUTS`; output float32 [N / merge^2, out_hidden]."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.full_blocks = set(cfg["fullatt_block_indexes"])
        self.patch_embed = tower_layers.PatchEmbed(cfg, bias=False)
        self.blocks = nn.ModuleList([
            tower_layers.VisionBlock(cfg["hidden_size"], cfg["num_heads"], cfg["intermediate_size"], cfg["hidden_act"],
                               NORM_EPS, qkv_bias=True, proj_bias=True, mlp_bias=True)
            for _ in range(cfg["depth"])])
        self.merger = PatchMerger(cfg)

    def forward(self, pixel_values, rotary_cos, rotary_sin, window_index, window_mask, window_inverse,
                full_index, full_mask, full_inverse):
        x = tower_layers.residual_stream(self.patch_embed(pixel_values))
        cos, sin = rotary_cos.float()[:, None, None, :], rotary_sin.float()[:, None, None, :]
        window_mask, full_mask = window_mask.float(), full_mask.float()
        window_len, full_len = tower_layers.key_lengths(window_mask), tower_layers.key_lengths(full_mask)
        for i, block in enumerate(self.blocks):
            if i in self.full_blocks:
                x = block(x, cos, sin, full_index, full_mask, full_inverse, full_len)
            else:
                x = block(x, cos, sin, window_index, window_mask, window_inverse, window_len)
        return self.merger(x).float()


class Qwen2_5_VLTower(Tower):
    module = Qwen2_5_VLVisionTower
    METADATA_INPUTS = METADATA_INPUTS
    METADATA_AXES = {**attention_groups.FRAME_AXES, "window_index": {0: "windows", 1: "window_len"},
                     "window_mask": {0: "windows", 1: "window_len"}, "window_inverse": {0: "patches"}}
    vision_settings = staticmethod(vision_settings)
    encoder_metadata = staticmethod(encoder_metadata)
    profile_shapes = staticmethod(profile_shapes)
