"""MiniCPM-V 4.6 vision tower (`minicpmv4_6`): an export-friendly re-implementation of transformers'
`MiniCPMV4_6VisionModel` plus `MiniCPMV4_6Merger` (what `get_image_features` /
`get_video_features` compute) and its host-side metadata.

Input convention: `pixel_values` has one row per patch_size x patch_size patch, its values in the
order of the patch-embedding Conv2d weight ([C, ph, pw]); the patches of a slice in row-major
order, slices (the processor's overview image and slices, or video frames) one after another in
prompt order. `grid_thw` has one row `[1, h, w]` per slice: the processor's `target_sizes` row
with t = 1 (a row with t > 1 is t slices of h x w). `patch_rows` turns transformers' packed
`pixel_values` into these rows. Each slice is encoded on its own (attention never crosses
slices) and gives (h / 4) x (w / 4) embedding rows, row-major, slices in order: the rows that
replace the slice's placeholder tokens (`spatial_merge_size` 4 = the 2x2 window merger times the
2x2 merger). With `downsample_mode` "4x" the window merger is skipped (`get_image_features`'
`use_vit_merger=False`): (h / 2) x (w / 2) rows, `spatial_merge_size` 2. MiniCPM-V 4.7 and
MiniCPM-OCR run this same tower.

Op order, as transformers runs it: the patch embedding (Conv2d with bias) plus learned position
embeddings picked by nearest bucket on a square grid (`get_vision_nearest_position_ids`);
SigLIP blocks (LayerNorm, attention over the slice, LayerNorm, GELU-tanh MLP) up to
`insert_layer_id`; the window-attention merger (LayerNorm, attention inside each 2x2 window,
residual, then the window's four rows joined: LayerNorm, Linear, GELU-tanh, Linear, plus the
window mean); the remaining blocks over the merged slice; `post_layernorm`; the merger
(`merger_times` rounds of 2x2 rows joined: LayerNorm, Linear, GELU, Linear).

Attention inside a slice does not depend on the order of its rows (no rotary, positions enter
only at the embedding), so the tower works in one order that makes every merge a reshape: the
host's `patch_order` gathers the rows so that each 2x2 window is four adjacent rows (row-major
inside the window), the windows of a merger block are adjacent in turn, and the final blocks
come in row-major order. The host also gives each (gathered) row its `position_ids` and the
per-slice attention groups before (`full_*`) and after (`merged_*`) the window merger (see
`triton_vlm.vision.tower.attention_groups`); window attention needs none (groups of four adjacent rows).
"""
from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch.nn as nn

from triton_vlm.vision.tower import attention_groups
from triton_vlm.vision.tower import config as tower_config
from triton_vlm.vision.tower import layers as tower_layers
from triton_vlm.vision.tower import trt_profile
from triton_vlm.vision.tower.base import Tower
from triton_vlm.vision.tower.siglip import EncoderLayer, SiglipAttention

METADATA_INPUTS = ("patch_order", "position_ids") + attention_groups.FULL_INPUTS + ("merged_index", "merged_mask",
                                                                          "merged_inverse")

# Fields read from the model config (`MiniCPMV4_6Config`, top level) and its vision_config
# (`MiniCPMV4_6VisionConfig`), with Hugging Face's defaults.
_DEFAULTS: dict[str, Any] = dict(insert_layer_id=6, merge_kernel_size=(2, 2), merger_times=1)
_VISION_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, num_channels=3,
    image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, window_kernel_size=(2, 2),
)
MERGER_EPS = 1e-6  # the merger's LayerNorm (fixed in transformers, not a config field)
PREFIXES = {"model.vision_tower.": "vision_tower.", "model.merger.": "merger.",
            "vision_tower.": "vision_tower.", "merger.": "merger."}


def vision_settings(config: Any, downsample_mode: str = "16x") -> dict[str, Any]:
    """Normalise a MiniCPM-V 4.6 model config (HF config object or `config.json` dict: the top
    level, which holds the merger fields, with `vision_config` and `text_config` inside) into a
    plain JSON-able dict of the fields this module uses. `downsample_mode`: the config class's
    default, where the config leaves it out (MiniCPM-OCR's is "4x")."""
    cfg = tower_config.as_dict(config)
    vision = tower_config.as_dict(cfg.get("vision_config") or {})
    text = tower_config.as_dict(cfg.get("text_config") or {})
    out = {key: vision.get(key, default) for key, default in _VISION_DEFAULTS.items()}
    defaults = {**_DEFAULTS, "downsample_mode": downsample_mode}
    out.update({key: cfg.get(key, default) for key, default in defaults.items()})
    # "16x": the window merger after `insert_layer_id`, then the merger; "4x" skips the window merger.
    out["window_merger"] = out["downsample_mode"] != "4x"
    if out["downsample_mode"] not in ("4x", "16x") or (
            out["window_merger"] and not 0 <= int(out["insert_layer_id"]) < int(out["num_hidden_layers"])):
        raise ValueError("MiniCPM-V: downsample_mode must be 16x (with the window merger inside the tower) or 4x "
                         f"(downsample_mode {out['downsample_mode']!r}, insert_layer_id {out['insert_layer_id']})")
    for key in ("image_size", "patch_size", "window_kernel_size", "merge_kernel_size"):
        out[key] = tower_config.square(out[key], key)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                "insert_layer_id", "merger_times"):
        out[key] = int(out[key])
    out["layer_norm_eps"] = float(out["layer_norm_eps"])
    out["out_hidden_size"] = int(text.get("hidden_size", out["hidden_size"]))
    out["pos_embed_size"] = out["image_size"] // out["patch_size"]  # position-embedding grid side
    # patches per embedding row along each side
    out["spatial_merge_size"] = (out["window_kernel_size"] if out["window_merger"] else 1) \
        * out["merge_kernel_size"] ** out["merger_times"]
    out.update(depth=out["num_hidden_layers"], num_heads=out["num_attention_heads"],
               in_channels=out["num_channels"], temporal_patch_size=1)
    return tower_config.add_derived(out)


def patch_rows(pixel_values: Any) -> np.ndarray:
    """transformers' packed `pixel_values` [B, C, patch, L] (patch k of the sequence is
    `[:, :, :, k * patch:(k + 1) * patch]`; B frames one after another, as `get_video_features`
    joins them) as this tower's rows [B * L / patch, C * patch * patch]."""
    x = np.asarray(pixel_values)
    b, c, p, length = x.shape
    x = np.moveaxis(x, 0, 2).reshape(c, p, b * length // p, p)
    return np.ascontiguousarray(x.transpose(2, 0, 1, 3).reshape(-1, c * p * p))


# --------------------------------------------------------------------------------------------
# Host-side metadata (numpy)
# --------------------------------------------------------------------------------------------

def nearest_buckets(size: int, side: int) -> np.ndarray:
    """Bucket of each of `size` coordinates i / size on a `side` grid, as transformers'
    `get_vision_nearest_position_ids` forms it (float32 coordinates, boundaries from a float32
    `arange(1 / side, 1, 1 / side)`, right-closed)."""
    step = 1.0 / side
    count = int(np.ceil((1.0 - step) / step))
    boundaries = (step + np.arange(count, dtype=np.float64) * step).astype(np.float32)
    coords = np.arange(size, dtype=np.float32) / np.float32(size)
    return np.searchsorted(boundaries, coords, side="right").astype(np.int64)


def merge_order(h: int, w: int, factors: list[int]) -> np.ndarray:
    """Row-major indices of an h x w grid in the order where every merge (`factors`, innermost
    first) joins adjacent rows: blocks of the last merge row-major, then recursively the
    sub-blocks, each block's parts row-major."""
    index = np.arange(h * w, dtype=np.int64).reshape(h, w, 1)
    for f in factors:
        rows, cols = index.shape[0] // f, index.shape[1] // f
        index = index.reshape(rows, f, cols, f, -1).transpose(0, 2, 1, 3, 4).reshape(rows, cols, -1)
    return index.reshape(-1)


def _slice_layout(h: int, w: int, cfg: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """One slice: patch order and the position id of each gathered patch."""
    window = [cfg["window_kernel_size"]] if cfg["window_merger"] else []
    order = merge_order(h, w, window + [cfg["merge_kernel_size"]] * cfg["merger_times"])
    side = cfg["pos_embed_size"]
    pos = (nearest_buckets(h, side)[:, None] * side + nearest_buckets(w, side)[None, :]).reshape(-1)
    return order, pos[order]


def encoder_metadata(grid_thw: np.ndarray, settings: dict[str, Any]) -> dict[str, np.ndarray]:
    """The tower's metadata inputs for `grid_thw` [M, 3] (one row per slice), computed with numpy.

    Keys: `METADATA_INPUTS`. Requires at least one slice."""
    grid = attention_groups.check_grid(grid_thw, settings["spatial_merge_size"])
    orders, positions = [], []
    for t, h, w, offset, (order, pos) in attention_groups.item_layouts(grid, lambda h, w: _slice_layout(h, w, settings)):
        for f in range(t):
            orders.append(order + offset + f * h * w)
            positions.append(pos)
    full = attention_groups.frame_groups(grid)
    # Without the window merger ("4x") the merged groups are never read: the full ones stand in.
    window = settings["window_kernel_size"] if settings["window_merger"] else 1
    merged = full if window == 1 else attention_groups.frame_groups(np.concatenate([grid[:, :1], grid[:, 1:] // window], axis=1))
    return dict(patch_order=np.concatenate(orders), position_ids=np.concatenate(positions), **full,
                **{f"merged_{key[5:]}": value for key, value in merged.items()})


def profile_shapes(settings: dict[str, Any], patches: tuple[int, int, int]) -> trt_profile.Shapes:
    """TensorRT (min, opt, max) shape of every input for runs of `patches` (min, opt, max) rows:
    a slice holds at least merge^2 patches, and merge^2 / window^2 rows after the window merger."""
    window_unit = settings["window_kernel_size"] ** 2 if settings["window_merger"] else 1
    unit = settings["spatial_merge_size"] ** 2
    merged_rows = tuple(max(1, p // window_unit) for p in patches)
    return {"pixel_values": trt_profile.per_patch(patches, settings["patch_dim"]),
            "patch_order": trt_profile.per_patch(patches), "position_ids": trt_profile.per_patch(patches),
            **trt_profile.group_profile("full", patches, unit),
            **trt_profile.group_profile("merged", merged_rows, unit // window_unit)}


# --------------------------------------------------------------------------------------------
# Torch tower (parameter names match the Hugging Face state_dict under `model.`)
# --------------------------------------------------------------------------------------------


class Embeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        p = cfg["patch_size"]
        self.patch_embedding = nn.Conv2d(cfg["in_channels"], cfg["hidden_size"], kernel_size=p, stride=p)
        self.position_embedding = nn.Embedding(cfg["pos_embed_size"] ** 2, cfg["hidden_size"])

    def forward(self, pixel_values, position_ids):
        return (tower_layers.residual_stream(tower_layers.patch_linear(pixel_values, self.patch_embedding))
                + self.position_embedding(position_ids))


class WindowMerger(nn.Module):
    """Attention inside each window of adjacent rows, then each window joined into one row."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.size = cfg["window_kernel_size"] ** 2
        self.self_attn = SiglipAttention(dim, cfg["num_heads"])
        self.layer_norm1 = tower_layers.LayerNorm(dim, eps=eps)
        self.pre_norm = tower_layers.LayerNorm(dim * self.size, eps=eps)
        self.linear_1 = nn.Linear(dim * self.size, cfg["intermediate_size"] * self.size)
        self.act = tower_layers.activation("gelu_pytorch_tanh")
        self.linear_2 = nn.Linear(cfg["intermediate_size"] * self.size, dim)

    def forward(self, x):
        n, dim = x.shape
        x = x + self.self_attn.windows(self.layer_norm1(x), self.size)
        window = x.reshape(n // self.size, self.size, dim)
        joined = self.linear_2(self.act(self.linear_1(self.pre_norm(window.reshape(n // self.size, -1)))))
        return joined + window.mean(dim=1)


class DownsampleMLP(nn.Module):
    """LayerNorm, Linear, GELU, Linear over the joined rows of one merge block."""

    def __init__(self, dim: int, out: int):
        super().__init__()
        self.pre_norm = tower_layers.LayerNorm(dim, eps=MERGER_EPS)
        self.linear_1 = nn.Linear(dim, dim)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(dim, out)

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(self.pre_norm(x))))


class MiniCPMV4_6VisionTower(nn.Module):
    """Inputs: `pixel_values` [N, patch_dim] plus `METADATA_INPUTS`; output float32 [N / merge^2, out_hidden]."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.insert_layer_id = cfg["insert_layer_id"] if cfg["window_merger"] else -1
        self.vision_tower = nn.Module()
        self.vision_tower.embeddings = Embeddings(cfg)
        self.vision_tower.encoder = nn.Module()
        self.vision_tower.encoder.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg["depth"])])
        self.vision_tower.post_layernorm = tower_layers.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])
        self.vision_tower.vit_merger = WindowMerger(cfg)
        self.merger = nn.Module()
        joined = cfg["hidden_size"] * cfg["merge_kernel_size"] ** 2
        outs = [cfg["hidden_size"]] * (cfg["merger_times"] - 1) + [cfg["out_hidden_size"]]
        self.merger.mlp = nn.ModuleList([DownsampleMLP(joined, out) for out in outs])

    def forward(self, pixel_values, patch_order, position_ids, full_index, full_mask, full_inverse,
                merged_index, merged_mask, merged_inverse):
        tower = self.vision_tower
        x = tower.embeddings(pixel_values.index_select(0, patch_order), position_ids)
        full_mask = full_mask.float()
        groups = (full_index, full_mask, full_inverse, tower_layers.key_lengths(full_mask))
        for i, layer in enumerate(tower.encoder.layers):
            x = layer(x, *groups)
            if i == self.insert_layer_id:
                x = tower.vit_merger(x)
                merged_mask = merged_mask.float()
                groups = (merged_index, merged_mask, merged_inverse, tower_layers.key_lengths(merged_mask))
        x = tower.post_layernorm(x)
        for mlp in self.merger.mlp:
            x = mlp(x.reshape(-1, mlp.pre_norm.normalized_shape[0]))
        return x.float()


class MiniCPMV4_6Tower(Tower):
    """Its settings come from the whole `config.json` (the merger fields are at its top level)."""
    module = MiniCPMV4_6VisionTower
    METADATA_INPUTS = METADATA_INPUTS
    METADATA_AXES = {
        "patch_order": {0: "patches"}, "position_ids": {0: "patches"},
        "full_index": {0: "slices", 1: "slice_len"}, "full_mask": {0: "slices", 1: "slice_len"},
        "full_inverse": {0: "patches"},
        "merged_index": {0: "slices", 1: "merged_len"}, "merged_mask": {0: "slices", 1: "merged_len"},
        "merged_inverse": {0: "merged_rows"},
    }
    PREFIXES = PREFIXES
    EXAMPLE_GRID = ((1, 8, 12), (2, 8, 8))
    vision_settings = staticmethod(vision_settings)
    encoder_metadata = staticmethod(encoder_metadata)
    profile_shapes = staticmethod(profile_shapes)
    WHOLE_CONFIG = True


class MiniCPMOcrTower(MiniCPMV4_6Tower):
    """MiniCPM-OCR's tower (`minicpm_ocr`): 4.6's, its config defaulting to `downsample_mode` "4x"."""
    vision_settings = staticmethod(partial(vision_settings, downsample_mode="4x"))
