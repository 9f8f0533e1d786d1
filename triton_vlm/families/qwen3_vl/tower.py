"""Qwen3-VL vision tower (`qwen3_vl_vision`, shared by Qwen3-VL, Qwen3-VL-MoE and the families on
its tower): an export-friendly re-implementation of transformers' `Qwen3VLVisionModel` plus its
host-side metadata. Qwen3.5's (`Qwen3_5VisionModel`, `Qwen3_5Tower`) is the same tower without
DeepStack: its vision config has no `deepstack_visual_indexes`.

Op order, as transformers runs it: Conv3d patch embedding (with bias); plus the learned position
table (`pos_embed`, a side x side grid, side = sqrt(num_position_embeddings)) resampled bilinearly
with align_corners to each frame's h x w patch grid; blocks (LayerNorm, attention over each frame
with Qwen2-VL's 2-D rotary, LayerNorm, fc1 / gelu_tanh / fc2); the merger (LayerNorm per patch,
2x2 concatenated, fc1, GELU, fc2). DeepStack: after each block in `deepstack_visual_indexes` a
merger of its own (2x2 concatenated first, then LayerNorm over the 4 patches) gives a feature map.

The output row of each merged token is the merger's output followed by each DeepStack map, in
`deepstack_visual_indexes` order (`triton_vlm.contract.tensors.embedding_width`): what the llm
adds after its first decoder layers travels with the row it belongs to through batching, the
encoder cache and EVS.

Patches stay in the processor's order (frame, merge-block row, merge-block column, 2x2 patches of
the block). The host computes (`triton_vlm.vision.tower.attention_groups`) the rotary tables, the
per-frame attention groups (`full_*`, i.e. `cu_seqlens`) and the position-table taps: `pos_index`
int64 [N, 4] and `pos_weight` float32 [N, 4], each patch's four table rows and bilinear weights
(`vision_utils.get_vision_interpolation_indices_and_weights`, in float32 as transformers forms them).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn as nn

from triton_vlm.contract.tensors import embedding_width
from triton_vlm.families.qwen3_vl import DEEPSTACK_INDEXES
from triton_vlm.vision.tower import attention_groups
from triton_vlm.vision.tower import config as tower_config
from triton_vlm.vision.tower import layers as tower_layers
from triton_vlm.vision.tower import trt_profile
from triton_vlm.vision.tower.base import Tower

LN_EPS = 1e-6  # fixed in the Hugging Face implementation (not a config field)

# The vision-config fields the tower and its metadata read, with Hugging Face's defaults
# (`Qwen3VLVisionConfig`; its axial rotary's theta is the base config's 10000; `config_fields` reads
# `rope_parameters.rope_theta`).
_DEFAULTS: dict[str, Any] = dict(
    depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304, num_heads=16,
    in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
    num_position_embeddings=2304, deepstack_visual_indexes=list(DEEPSTACK_INDEXES), rope_theta=10000.0,
)


# `Qwen3_5VisionConfig`: Qwen3-VL's fields and defaults, no DeepStack.
QWEN3_5_DEFAULTS: dict[str, Any] = {**_DEFAULTS, "deepstack_visual_indexes": []}


def vision_settings(vision_config: Any, defaults: dict[str, Any] = _DEFAULTS) -> dict[str, Any]:
    """Normalise a vision config (HF config object or dict, e.g. `config.json`'s `vision_config`)
    into a plain JSON-able dict of the fields this module uses (`defaults`: its config class's)."""
    out = tower_config.config_fields(vision_config, defaults)
    for key in ("patch_size", "temporal_patch_size"):
        out[key] = tower_config.square(out[key], key)
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "spatial_merge_size",
                "out_hidden_size", "num_position_embeddings"):
        out[key] = int(out[key])
    rope_type = (tower_config.as_dict(vision_config).get("rope_parameters") or {}).get("rope_type", "axial")
    if rope_type != "axial":
        raise ValueError(f"vision_config.rope_parameters: rope_type {rope_type!r} is not supported (axial)")
    out["deepstack_visual_indexes"] = [int(i) for i in out["deepstack_visual_indexes"] or ()]
    if bad := [i for i in out["deepstack_visual_indexes"] if not 0 <= i < out["depth"]]:
        raise ValueError(f"vision_config.deepstack_visual_indexes {bad} are not blocks of a depth-{out['depth']} tower")
    out["pos_side"] = int(out["num_position_embeddings"] ** 0.5)
    return tower_config.add_derived(out)


def qwen3_5_vision_settings(vision_config: Any) -> dict[str, Any]:
    """`vision_settings` of a Qwen3.5 vision config; DeepStack maps (which its model never reads)
    are refused by name."""
    if tower_config.as_dict(vision_config).get("deepstack_visual_indexes"):
        raise ValueError("vision_config.deepstack_visual_indexes: Qwen3.5's tower has no DeepStack")
    return vision_settings(vision_config, QWEN3_5_DEFAULTS)


# --------------------------------------------------------------------------------------------
# Host-side metadata (numpy)
# --------------------------------------------------------------------------------------------

def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor + 1, clamped to the table) and weights along one axis,
    align_corners: `_interpolation_axis_taps_weights` in float32."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weights = np.maximum(np.float32(1) - np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32)),
                         np.float32(0)).astype(np.float32)
    return taps, weights


def _frame_layout(h: int, w: int, m: int, side: int, inv_freq: np.ndarray):
    """One frame of an h x w patch grid, processor order: rotary cos / sin [h*w, head_dim], the
    position-table rows [h*w, 4] and their weights [h*w, 4]."""
    hpos, wpos = attention_groups.patch_positions(h, w, m)
    cos, sin = attention_groups.rotary_tables(hpos, wpos, inv_freq)
    h_taps, h_weights = _axis_taps(hpos, h, side)
    w_taps, w_weights = _axis_taps(wpos, w, side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return cos, sin, index, weight


def encoder_metadata(grid_thw: np.ndarray, settings: dict[str, Any]) -> dict[str, np.ndarray]:
    """The tower's metadata inputs for `grid_thw` [M, 3] (processor order), computed with numpy.

    Keys: `Qwen3VLTower.METADATA_INPUTS`. Requires at least one item."""
    m = settings["spatial_merge_size"]
    grid = attention_groups.check_grid(grid_thw, m)
    inv_freq = attention_groups.rotary_inv_freq(settings["head_dim"], settings["rope_theta"])
    cos, sin, index, weight = attention_groups.per_frame_tables(
        grid, lambda h, w: _frame_layout(h, w, m, settings["pos_side"], inv_freq))
    return dict(rotary_cos=cos, rotary_sin=sin, pos_index=index, pos_weight=weight,
                **attention_groups.frame_groups(grid))


def profile_shapes(settings: dict[str, Any], patches: tuple[int, int, int]) -> trt_profile.Shapes:
    """TensorRT (min, opt, max) shape of every input for runs of `patches` (min, opt, max) rows."""
    taps = trt_profile.per_patch(patches, 4)
    return {**trt_profile.frame_profile(settings, patches), "pos_index": taps, "pos_weight": taps}


# --------------------------------------------------------------------------------------------
# Torch tower (parameter names match the Hugging Face state_dict under `model.visual.`)
# --------------------------------------------------------------------------------------------

class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        self.act_fn = tower_layers.activation(act)

    def forward(self, x):
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """LayerNorm per patch then 2x2 concatenated (`use_postshuffle_norm` False: the final merger),
    or concatenated then LayerNorm over the four (True: a DeepStack merger); fc1, GELU, fc2."""

    def __init__(self, cfg: dict[str, Any], postshuffle: bool):
        super().__init__()
        self.hidden = cfg["hidden_size"] * cfg["spatial_merge_size"] ** 2
        self.postshuffle = postshuffle
        self.norm = tower_layers.LayerNorm(self.hidden if postshuffle else cfg["hidden_size"], eps=LN_EPS)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.hidden, cfg["out_hidden_size"])

    def forward(self, x):
        x = self.norm(x.reshape(-1, self.hidden)) if self.postshuffle else self.norm(x).reshape(-1, self.hidden)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3VLVisionTower(nn.Module):
    """Inputs: `pixel_values` [N, patch_dim] plus `Qwen3VLTower.METADATA_INPUTS`; output float32
    [N / merge^2, out_hidden * (1 + DeepStack maps)]."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.patch_embed = tower_layers.PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg["num_position_embeddings"], cfg["hidden_size"])
        dim, hidden, act = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_act"]
        self.blocks = nn.ModuleList([  # LayerNorms and a plain MLP of HF's `linear_fc1` / `linear_fc2`
            tower_layers.VisionBlock(dim, cfg["num_heads"], hidden, act, LN_EPS, qkv_bias=True, proj_bias=True,
                                     mlp_bias=True, norm=tower_layers.LayerNorm, mlp=VisionMLP(dim, hidden, act))
            for _ in range(cfg["depth"])])
        self.merger = PatchMerger(cfg, postshuffle=False)
        self.deepstack_visual_indexes = list(cfg["deepstack_visual_indexes"])
        self.deepstack_merger_list = nn.ModuleList([PatchMerger(cfg, postshuffle=True)
                                                    for _ in self.deepstack_visual_indexes])

    def forward(self, pixel_values, rotary_cos, rotary_sin, pos_index, pos_weight, full_index, full_mask,
                full_inverse):
        x = tower_layers.residual_stream(self.patch_embed(pixel_values))
        # transformers: the model-dtype table rows times the float32 weights, summed, cast to x's dtype
        pos = (self.pos_embed(pos_index) * pos_weight.float()[:, :, None]).sum(1)
        x = x + pos.to(self.patch_embed.proj.weight.dtype)
        cos, sin = rotary_cos.float()[:, None, None, :], rotary_sin.float()[:, None, None, :]
        full_mask = full_mask.float()
        full_len = tower_layers.key_lengths(full_mask)
        maps = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full_index, full_mask, full_inverse, full_len)
            if i in self.deepstack_visual_indexes:
                maps.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x).float())
        return torch.cat([self.merger(x).float(), *maps], dim=-1)


class Qwen3VLTower(Tower):
    module = Qwen3VLVisionTower
    METADATA_INPUTS = attention_groups.ROTARY_INPUTS + ("pos_index", "pos_weight") + attention_groups.FULL_INPUTS
    METADATA_AXES = {**attention_groups.FRAME_AXES, "pos_index": {0: "patches"}, "pos_weight": {0: "patches"}}
    vision_settings = staticmethod(vision_settings)
    encoder_metadata = staticmethod(encoder_metadata)
    profile_shapes = staticmethod(profile_shapes)

    @classmethod
    def embedding_width(cls, settings: dict[str, Any]) -> int:
        return embedding_width(settings["out_hidden_size"], len(settings["deepstack_visual_indexes"]))


class Qwen3_5Tower(Qwen3VLTower):
    """Qwen3.5's tower (`Qwen3_5VisionModel`): Qwen3-VL's with no DeepStack maps."""
    vision_settings = staticmethod(qwen3_5_vision_settings)
