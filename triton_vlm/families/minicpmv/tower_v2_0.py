"""MiniCPM-V 2.0's vision tower (`MiniCPMV2_0Tower`): the official `MiniCPMV.vpm`, timm's SigLIP
so400m ViT (`vit_so400m_patch14_siglip_384`: no class token, no pooling, its last block dropped by
`drop_vision_last_layer`), and `resampler` (2.0's `resampler.py`) in an export-friendly form, with
its host-side metadata.

Input convention as `triton_vlm.families.minicpmv.tower_resampler`: one `pixel_values` row per
14 x 14 patch in the Conv2d weight's (channel, dy, dx) order, each slice's patches row-major,
slices one after another; `grid_thw` has one row `[1, h, w]` per slice (the official `tgt_sizes`
row). The official code runs the tower once per slice (`get_vision_embedding`), so attention
stays inside each slice (one group per slice, `attention_groups.frame_groups`), for the ViT and
the resampler alike, and each slice gives `query_num` rows.

Op order, as the official code and timm run it: the patch embedding (Conv2d with bias), plus the
learned 27 x 27 position table resampled to the slice's h x w patches (timm's
`resample_abs_pos_embed`: `F.interpolate(mode="bicubic", antialias=True, align_corners=False)` in
float32); pre-norm blocks (LayerNorm eps 1e-6, attention with qkv bias, exact-erf GELU MLP); the
final `norm`; the resampler: `kv_proj`, `ln_kv`, keys plus the 2-D sin-cos of (h, w), queries
`ln_q(query)` plus the stored query sin-cos (`Resampler2_0`), `ln_post`, `@ proj`.

The antialiased bicubic resampling is separable: the table's value at patch (r, c) is
`sum_ij R[r, i] C[c, j] table[i, j]` with one weight matrix per axis (`axis_weights`, taken
from `F.interpolate` itself on an identity basis). The host gives each patch its row of R and of C
(`row_weights`, `col_weights`, float32 [patches, 27]); the graph forms their outer product and
one MatMul with the table. At 27 patches an axis's matrix is exactly the identity, so a 27 x 27
slice gets the table as it is, as timm leaves it unresampled.

No config key sizes the tower: its width, depth, MLP width and position grid come from the
checkpoint's weights (`weight_settings`), its heads are 72 wide (so400m's).
"""
from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn as nn

from triton_vlm.families.minicpmv.resampler import LAYER_NORM_EPS, Resampler2_0
from triton_vlm.vision.tower import attention_groups
from triton_vlm.vision.tower import config as tower_config
from triton_vlm.vision.tower import layers as tower_layers
from triton_vlm.vision.tower import trt_profile
from triton_vlm.vision.tower.base import Tower
from triton_vlm.vision.tower.siglip import SiglipMLP
from triton_vlm.weights import read_shapes

METADATA_INPUTS = ("row_weights", "col_weights") + attention_groups.FULL_INPUTS + ("key_positions",)
VISION_ENCODER = "vit_so400m_patch14_siglip_384.webli"  # the only tower 2.0's config names
PATCH_SIZE = 14
HEAD_DIM = 72  # so400m's: 1152 wide, 16 heads
PREFIXES = {"vpm.": "vpm.", "resampler.": "resampler."}


def vision_settings(config: Any) -> dict[str, Any]:
    """What a MiniCPM-V 2.0 `config.json` says of the tower: the resampler's width (the decoder's
    `hidden_size`) and `query_num` (the official `MiniCPMVConfig`'s default 64 where left out).
    The sizes only the weights give are added by `weight_settings`."""
    cfg = tower_config.as_dict(config)
    encoder = cfg.get("vision_encoder", VISION_ENCODER)
    if encoder != VISION_ENCODER:
        raise ValueError(f"MiniCPM-V 2.0: vision_encoder {encoder!r} is not supported (only {VISION_ENCODER})")
    return dict(out_hidden_size=int(cfg["hidden_size"]), query_num=int(cfg.get("query_num", 64)),
                patch_size=PATCH_SIZE, in_channels=3, temporal_patch_size=1, spatial_merge_size=1,
                patch_dim=3 * PATCH_SIZE ** 2, layer_norm_eps=LAYER_NORM_EPS, hidden_act="gelu")


def sized_settings(settings: dict[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """`settings` with the tower's sizes read off the shapes of its `vpm.*` weights: depth (the
    blocks the checkpoint holds: the official code dropped its last one before saving), width and
    position grid (`vpm.pos_embed` [1, side^2, width]), MLP width (`mlp.fc1.weight` rows); heads
    of `HEAD_DIM`."""
    blocks = {int(key.split(".")[2]) for key in shapes if key.startswith("vpm.blocks.")}
    if not blocks or blocks != set(range(len(blocks))):
        raise ValueError(f"MiniCPM-V 2.0: the vision blocks in the weights are not 0..N-1: {sorted(blocks)}")
    _, positions, width = shapes["vpm.pos_embed"]
    side = math.isqrt(positions)
    if side * side != positions or width % HEAD_DIM:
        raise ValueError(f"MiniCPM-V 2.0: vpm.pos_embed {list(shapes['vpm.pos_embed'])} is not a square grid "
                         f"of a width that {HEAD_DIM}-wide heads divide")
    out = dict(settings, hidden_size=width, depth=len(blocks), num_heads=width // HEAD_DIM, pos_embed_size=side,
               intermediate_size=shapes["vpm.blocks.0.mlp.fc1.weight"][0])
    return tower_config.add_derived(out)


# --------------------------------------------------------------------------------------------
# Host-side metadata
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def axis_weights(size: int, side: int) -> np.ndarray:
    """float32 [size, side]: the antialiased bicubic weights that resample one axis of `side`
    table rows to `size` patches, row k the weights of patch k. `F.interpolate` on the identity
    (the other axis kept at `side`, where its weights are exactly the identity) gives them as
    timm's `resample_abs_pos_embed` uses them."""
    eye = torch.eye(side, dtype=torch.float32)[None, None]
    out = nn.functional.interpolate(eye, size=(size, side), mode="bicubic", antialias=True, align_corners=False)
    weights = out[0, 0].numpy()
    weights.flags.writeable = False  # cached: shared by every call
    return weights


def slice_layout(h: int, w: int, side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row weights, column weights, (row, column)) of each patch of an h x w slice, row-major."""
    rows, cols = np.divmod(np.arange(h * w, dtype=np.int64), w)
    return axis_weights(h, side)[rows], axis_weights(w, side)[cols], np.stack([rows, cols], axis=1)


def metadata(grid_thw: np.ndarray, settings: dict[str, Any]) -> dict[str, np.ndarray]:
    """The metadata inputs for `grid_thw` [M, 3] (rows [1, h, w]: one slice each)."""
    grid = attention_groups.check_grid(grid_thw, 1)
    if (grid[:, 0] != 1).any():
        raise ValueError(f"MiniCPM-V 2.0: grid_thw rows are single slices [1, h, w]: {grid.tolist()}")
    side = settings["pos_embed_size"]
    layouts = [layout for *_, layout in attention_groups.item_layouts(grid, lambda h, w: slice_layout(h, w, side))]
    row_weights, col_weights, keys = (np.concatenate(parts) for parts in zip(*layouts))
    return dict(row_weights=row_weights, col_weights=col_weights, **attention_groups.frame_groups(grid),
                key_positions=keys)


def profile_shapes(settings: dict[str, Any], patches: tuple[int, int, int]) -> trt_profile.Shapes:
    """TensorRT (min, opt, max) shapes for runs of `patches` rows (a slice holds one patch at the
    least)."""
    side = settings["pos_embed_size"]
    return {"pixel_values": trt_profile.per_patch(patches, settings["patch_dim"]),
            "row_weights": trt_profile.per_patch(patches, side), "col_weights": trt_profile.per_patch(patches, side),
            **trt_profile.group_profile("full", patches, 1), "key_positions": trt_profile.per_patch(patches, 2)}


# --------------------------------------------------------------------------------------------
# The torch module
# --------------------------------------------------------------------------------------------

class Block(nn.Module):
    """timm's pre-norm ViT block (`blocks.N`): x + attn(norm1(x)), then x + mlp(norm2(x)); no
    rotary, no layer scale."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.norm1, self.norm2 = tower_layers.LayerNorm(dim, eps=eps), tower_layers.LayerNorm(dim, eps=eps)
        self.attn = tower_layers.VisionAttention(dim, cfg["num_heads"], qkv_bias=True, proj_bias=True)
        self.mlp = SiglipMLP(dim, cfg["intermediate_size"], cfg["hidden_act"])

    def forward(self, x: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, inverse: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), None, None, index, mask, inverse, lengths)
        return x + self.mlp(self.norm2(x))


class MiniCPMV2_0VisionTower(nn.Module):
    """Inputs: `pixel_values` [N, patch_dim] plus `METADATA_INPUTS`; output float32
    [slices * query_num, out_hidden]."""
    HIDDEN_INPUTS = METADATA_INPUTS[:5]  # the metadata `hidden` takes, in order

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim, side = cfg["hidden_size"], cfg["pos_embed_size"]
        self.vpm = nn.Module()
        self.vpm.patch_embed = nn.Module()
        self.vpm.patch_embed.proj = nn.Conv2d(cfg["in_channels"], dim, kernel_size=cfg["patch_size"],
                                              stride=cfg["patch_size"])
        self.vpm.pos_embed = nn.Parameter(torch.zeros(1, side * side, dim))
        self.vpm.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg["depth"])])
        self.vpm.norm = tower_layers.LayerNorm(dim, eps=cfg["layer_norm_eps"])
        self.resampler = Resampler2_0(cfg)

    def positions(self, row_weights: torch.Tensor, col_weights: torch.Tensor) -> torch.Tensor:
        """float32 [N, width]: each patch's position embedding, the table resampled to its slice."""
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)
        return weights @ self.vpm.pos_embed[0].float()

    def hidden(self, pixel_values: torch.Tensor, row_weights: torch.Tensor, col_weights: torch.Tensor,
               full_index: torch.Tensor, full_mask: torch.Tensor, full_inverse: torch.Tensor) -> torch.Tensor:
        """`vpm.forward_features` of each slice: the final `norm`'s output."""
        x = tower_layers.residual_stream(tower_layers.patch_linear(pixel_values, self.vpm.patch_embed.proj))
        x = x + self.positions(row_weights, col_weights)
        full_mask = full_mask.float()
        lengths = tower_layers.key_lengths(full_mask)
        for block in self.vpm.blocks:
            x = block(x, full_index, full_mask, full_inverse, lengths)
        return self.vpm.norm(x)

    def forward(self, pixel_values: torch.Tensor, row_weights: torch.Tensor, col_weights: torch.Tensor,
                full_index: torch.Tensor, full_mask: torch.Tensor, full_inverse: torch.Tensor,
                key_positions: torch.Tensor) -> torch.Tensor:
        x = self.hidden(pixel_values, row_weights, col_weights, full_index, full_mask, full_inverse)
        return self.resampler(x, key_positions, full_index, full_mask).float()


class MiniCPMV2_0Tower(Tower):
    """2.0's: one group per image slice. Its settings come from the whole `config.json` (the
    resampler's) and the weights (the ViT's sizes, `weight_settings`)."""
    module = MiniCPMV2_0VisionTower
    METADATA_INPUTS = METADATA_INPUTS
    METADATA_AXES = {
        "row_weights": {0: "patches"}, "col_weights": {0: "patches"},
        **{name: attention_groups.FRAME_AXES[name] for name in attention_groups.FULL_INPUTS},
        "key_positions": {0: "patches"},
    }
    PREFIXES = PREFIXES
    EXAMPLE_GRID = ((1, 6, 10), (1, 8, 8))
    WHOLE_CONFIG = True
    vision_settings = staticmethod(vision_settings)
    encoder_metadata = staticmethod(metadata)
    profile_shapes = staticmethod(profile_shapes)

    @classmethod
    def weight_settings(cls, settings: dict[str, Any], checkpoint_dir: str | Path) -> dict[str, Any]:
        return sized_settings(settings, read_shapes(checkpoint_dir, lambda key: key.startswith("vpm.")))
