"""Qwen2-VL vision tower (transformers' `Qwen2VisionTransformerPretrainedModel`): Qwen2.5-VL's
without windows, as LayerNorm / quick-GELU blocks.

Op order, as transformers runs it: Conv3d patch embedding (no bias); blocks (LayerNorm, fused qkv
with bias, 2-D rotary, attention over each frame, proj; LayerNorm, fc1, `hidden_act`, fc2); the
merger (`ln_q` LayerNorm on each patch, the 2x2 merge block side by side, Linear, GELU, Linear).
Patches stay in the processor's order, as in Qwen2.5-VL's tower, and attention runs over the
per-frame groups (`full_*`, i.e. `cu_seqlens`) with the same rotary tables.

Its config names the tower's width `embed_dim` and the merger's output `hidden_size`, the MLP's
width `embed_dim * mlp_ratio`; `vision_settings` states them as the other towers do (`hidden_size`
the width, `out_hidden_size` the output, `intermediate_size`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch.nn as nn

from triton_vlm.families.qwen2_5_vl.tower import NORM_EPS, PatchMerger
from triton_vlm.vision.tower import attention_groups
from triton_vlm.vision.tower import config as tower_config
from triton_vlm.vision.tower import layers as tower_layers
from triton_vlm.vision.tower import trt_profile
from triton_vlm.vision.tower.base import Tower
from triton_vlm.vision.tower.siglip import SiglipMLP

# The vision-config fields the tower reads, with `Qwen2VLVisionConfig`'s defaults.
_DEFAULTS: dict[str, Any] = dict(
    depth=32, embed_dim=1280, hidden_size=3584, hidden_act="quick_gelu", mlp_ratio=4, num_heads=16,
    in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, rope_theta=10000.0,
)


def vision_settings(vision_config: Any) -> dict[str, Any]:
    """A Qwen2-VL vision config (HF config object or dict) as the plain dict of the fields the
    tower uses, in the other towers' names."""
    cfg = tower_config.config_fields(vision_config, _DEFAULTS)
    rope = tower_config.as_dict(vision_config).get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r} is not supported; "
                         "supported: axial")
    width = int(cfg["embed_dim"])
    out = dict(depth=int(cfg["depth"]), hidden_size=width, out_hidden_size=int(cfg["hidden_size"]),
               intermediate_size=int(width * cfg["mlp_ratio"]), hidden_act=cfg["hidden_act"],
               num_heads=int(cfg["num_heads"]), in_channels=int(cfg["in_channels"]),
               spatial_merge_size=int(cfg["spatial_merge_size"]), rope_theta=cfg["rope_theta"])
    for key in ("patch_size", "temporal_patch_size"):
        out[key] = tower_config.square(cfg[key], key)
    return tower_config.add_derived(out)


def encoder_metadata(grid_thw: np.ndarray, settings: dict[str, Any]) -> dict[str, np.ndarray]:
    """The tower's metadata inputs for `grid_thw` [M, 3] (processor order): every patch's rotary
    cos / sin, and one attention group per frame. Requires at least one item."""
    m = settings["spatial_merge_size"]
    grid = attention_groups.check_grid(grid_thw, m)
    inv_freq = attention_groups.rotary_inv_freq(settings["head_dim"], settings["rope_theta"])
    cos, sin = attention_groups.per_frame_tables(
        grid, lambda h, w: attention_groups.rotary_tables(*attention_groups.patch_positions(h, w, m), inv_freq))
    return dict(rotary_cos=cos, rotary_sin=sin, **attention_groups.frame_groups(grid))


class Qwen2VLVisionTower(nn.Module):
    """Inputs: `pixel_values` [N, patch_dim] plus `Qwen2VLTower.METADATA_INPUTS`; output float32
    [N / merge^2, out_hidden]."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim, hidden, act = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_act"]
        self.patch_embed = tower_layers.PatchEmbed(cfg, bias=False)
        self.blocks = nn.ModuleList([
            tower_layers.VisionBlock(dim, cfg["num_heads"], hidden, act, NORM_EPS, qkv_bias=True, proj_bias=True,
                                     mlp_bias=True, norm=tower_layers.LayerNorm, mlp=SiglipMLP(dim, hidden, act))
            for _ in range(cfg["depth"])])
        self.merger = PatchMerger(cfg, norm=tower_layers.LayerNorm)

    def forward(self, pixel_values, rotary_cos, rotary_sin, full_index, full_mask, full_inverse):
        x = tower_layers.residual_stream(self.patch_embed(pixel_values))
        cos, sin = rotary_cos.float()[:, None, None, :], rotary_sin.float()[:, None, None, :]
        full_mask = full_mask.float()
        full_len = tower_layers.key_lengths(full_mask)
        for block in self.blocks:
            x = block(x, cos, sin, full_index, full_mask, full_inverse, full_len)
        return self.merger(x).float()


class Qwen2VLTower(Tower):
    module = Qwen2VLVisionTower
    METADATA_INPUTS = attention_groups.ROTARY_INPUTS + attention_groups.FULL_INPUTS
    METADATA_AXES = attention_groups.FRAME_AXES
    vision_settings = staticmethod(vision_settings)
    encoder_metadata = staticmethod(encoder_metadata)

    @staticmethod
    def profile_shapes(settings: dict[str, Any], patches: tuple[int, int, int]) -> trt_profile.Shapes:
        return trt_profile.frame_profile(settings, patches)
