"""The vision tower of the official `MiniCPMV` class (2.5, 2.6, 4.0, 4.5; `MiniCPMV2_5Tower`,
`MiniCPMVTower`, `MiniCPMV4_5Tower`): the official `SiglipVisionTransformer`
(`modeling_navit_siglip.py`, the same file in 2.6, 4.0 and 4.5: NaViT position ids; 2.5's
transformers `Idefics2VisionTransformer` is the same model) and `Resampler` (`resampler`: 2.5's,
2.6's and 4.0's 2-D one, 4.5's with temporal ids) in an export-friendly form, and its host-side
metadata. 2.5's official code pads every slice of a request to the largest and attends over the
padding (`padded_metadata`, the `padded_patches` extra).

Input convention as `triton_vlm.families.minicpmv.tower_v4_6`: one `pixel_values` row per 14 x 14 patch in the
Conv2d weight's (channel, dy, dx) order, each slice's patches row-major, slices one after another.
`grid_thw` has one row `[t, h, w]` per resampler group: an image slice (t = 1, the processor's
`tgt_sizes` row) or a 4.5 video's packed frames (t of them, h x w each). SigLIP attends inside each
slice or frame; the resampler's `query_num` learned queries attend over the whole group, so each
grid row gives `query_num` embedding rows (`Tower.embedding_rows`), the rows of its `<unk>` run.

Keys of the resampler carry a 2-D sin-cos of their patch's (row, column) and, for a 4.5 video frame,
a 1-D sin-cos of its temporal id; the host gives each patch's (row, column, temporal id or -1) as
`key_positions` and the graph computes the tables (a [patches, hidden] table of an 8B model would
be 16 KiB a patch to send).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
import torch.nn as nn

from triton_vlm.families.minicpmv.padded_slices import embedding_rows, padded_frames
from triton_vlm.families.minicpmv.resampler import LAYER_NORM_EPS, Resampler, Resampler4_5
from triton_vlm.families.minicpmv.tower_v4_6 import Embeddings
from triton_vlm.vision.tower import attention_groups
from triton_vlm.vision.tower import config as tower_config
from triton_vlm.vision.tower import layers as tower_layers
from triton_vlm.vision.tower import trt_profile
from triton_vlm.vision.tower.base import Tower
from triton_vlm.vision.tower.siglip import EncoderLayer

METADATA_INPUTS = ("position_ids",) + attention_groups.FULL_INPUTS + ("key_positions", "group_index", "group_mask")
# The official `SiglipVisionConfig`'s defaults (what a `vision_config` leaves out), and the vision
# config `MiniCPMVConfig` takes where a config has none (`default_vision_config`).
_SIGLIP_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, num_channels=3,
    image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=LAYER_NORM_EPS,
)
# 2.5's tower is transformers' `Idefics2VisionTransformer`: `Idefics2VisionConfig`'s defaults.
_IDEFICS2_DEFAULTS: dict[str, Any] = {**_SIGLIP_DEFAULTS, "patch_size": 32}
_DEFAULT_VISION_CONFIG: dict[str, Any] = dict(
    hidden_size=1152, image_size=980, intermediate_size=4304, num_attention_heads=16, num_hidden_layers=27,
    patch_size=14,
)
PREFIXES = {"vpm.": "vpm.", "resampler.": "resampler."}


def vision_settings(config: Any, vision_defaults: dict[str, Any] = _SIGLIP_DEFAULTS) -> dict[str, Any]:
    """A MiniCPM-V `config.json` (its top level holds `query_num` and the decoder's `hidden_size`,
    the resampler's width) as the plain dict of the fields this module uses, read as the official
    `MiniCPMVConfig` reads them: what it leaves out, that class's defaults (`vision_defaults`: its
    vision config class's)."""
    cfg = tower_config.as_dict(config)
    if cfg.get("drop_vision_last_layer", True):  # the official default: the tower's last layer unused
        raise NotImplementedError("MiniCPM-V: drop_vision_last_layer (true, or left out: the official default) "
                                  "is not supported")
    given = cfg.get("vision_config")
    vision = _DEFAULT_VISION_CONFIG if given is None else tower_config.as_dict(given)
    out = {key: vision.get(key, default) for key, default in vision_defaults.items()}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                "image_size", "patch_size"):
        out[key] = int(out[key])
    out["layer_norm_eps"] = float(out["layer_norm_eps"])
    out["out_hidden_size"] = int(cfg["hidden_size"])
    out["query_num"] = int(cfg.get("query_num", 64))
    out["pos_embed_size"] = out["image_size"] // out["patch_size"]
    out.update(depth=out["num_hidden_layers"], num_heads=out["num_attention_heads"], in_channels=out["num_channels"],
               temporal_patch_size=1, spatial_merge_size=1)
    return tower_config.add_derived(out)


# --------------------------------------------------------------------------------------------
# Host-side metadata (numpy)
# --------------------------------------------------------------------------------------------

def navit_position_ids(h: int, w: int, side: int) -> np.ndarray:
    """`SiglipVisionEmbeddings.forward`'s (and `Idefics2VisionEmbeddings.forward`'s) position ids of
    an h x w slice on the `side` x `side` table: each axis's fractional coordinates (a float32
    `arange(0, 1 - 1e-6, 1 / n)`, n a tensor there, so the step is 1 / n in float32: at a
    1036-patch row that moves coordinates across boundaries) bucketised on
    `arange(1 / side, 1, 1 / side)`, right-closed."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    rows = torch.bucketize(torch.arange(0, 1 - 1e-6, float(np.float32(1 / h))), boundaries, right=True)
    cols = torch.bucketize(torch.arange(0, 1 - 1e-6, float(np.float32(1 / w))), boundaries, right=True)
    return (rows[:, None] * side + cols).flatten().numpy()


def metadata(grid_thw: np.ndarray, settings: dict[str, Any], temporal_ids: np.ndarray | None = None
             ) -> dict[str, np.ndarray]:
    """The metadata inputs for `grid_thw` [M, 3]; `temporal_ids`: each frame's temporal id, int64
    [sum of grid_thw[:, 0]] (a video's packed group, `choose_frames`), -1 (or None: all) for none."""
    grid = attention_groups.check_grid(grid_thw, 1)
    side = settings["pos_embed_size"]
    frames = int(grid[:, 0].sum())
    ids = np.full(frames, -1, np.int64) if temporal_ids is None else np.asarray(temporal_ids, np.int64).reshape(-1)
    if len(ids) != frames:
        raise ValueError(f"grid_thw holds {frames} frames but {len(ids)} temporal ids were given")
    starts = np.concatenate([[0], np.cumsum(grid[:, 0])])
    positions, keys = [], []
    for i, (t, h, w, _, pos) in enumerate(attention_groups.item_layouts(grid, lambda h, w: navit_position_ids(h, w, side))):
        rows, cols = np.divmod(np.arange(h * w, dtype=np.int64), w)
        for frame in ids[starts[i]:starts[i + 1]].tolist():
            positions.append(pos)
            keys.append(np.stack([rows, cols, np.full(h * w, frame, dtype=np.int64)], axis=1))
    patches = grid.prod(axis=1)
    index, mask, _ = attention_groups.groups(np.arange(int(patches.sum()), dtype=np.int64), patches)
    return dict(position_ids=np.concatenate(positions), **attention_groups.frame_groups(grid),
                key_positions=np.concatenate(keys), group_index=index, group_mask=mask)


PADDED_INPUTS = ("pixel_index",) + METADATA_INPUTS[:4] + ("real_rows",) + METADATA_INPUTS[4:]


def padded_metadata(grid_thw: np.ndarray, settings: dict[str, Any], padded_patches: np.ndarray | None = None
                    ) -> dict[str, np.ndarray]:
    """2.5's metadata (`PADDED_INPUTS`): every frame zero-padded to its grid row's `padded_patches`
    (none, 0: its own h * w), as the official batched `vpm` call pads each slice to the request's
    largest. Its position ids are those of a 1 x padded grid, it attends over the padding, and only
    its real patches go on to the resampler. `pixel_index`: each padded row's pixel row, the padding
    that one past the last (the graph appends a zero row); `real_rows`: each real patch's padded row.
    InvalidInput for `padded_patches` out of bounds (`padded_frames`)."""
    grid = attention_groups.check_grid(grid_thw, 1)
    real, padded = padded_frames(grid, padded_patches)
    padded_starts = np.r_[0, np.cumsum(padded)[:-1]]
    real_rows = np.concatenate([b + np.arange(n) for b, n in zip(padded_starts.tolist(), real.tolist())])
    pixel_index = np.full(int(padded.sum()), len(real_rows), np.int64)  # (the zero row the graph appends)
    pixel_index[real_rows] = np.arange(len(real_rows))
    side = settings["pos_embed_size"]
    table = {n: navit_position_ids(1, n, side) for n in set(padded.tolist())}
    positions = np.concatenate([table[n] for n in padded.tolist()])
    index, mask, inverse = attention_groups.groups(np.arange(len(pixel_index), dtype=np.int64), padded)
    return {**metadata(grid, settings), "pixel_index": pixel_index, "position_ids": positions, "full_index": index,
            "full_mask": mask, "full_inverse": inverse, "real_rows": real_rows}


def profile_shapes(settings: dict[str, Any], patches: tuple[int, int, int]) -> trt_profile.Shapes:
    """TensorRT (min, opt, max) shapes for runs of `patches` rows (a slice or a group holds one patch
    at the least)."""
    groups = trt_profile.group_profile("group", patches, 1)
    return {"pixel_values": trt_profile.per_patch(patches, settings["patch_dim"]), "position_ids": trt_profile.per_patch(patches),
            **trt_profile.group_profile("full", patches, 1), "key_positions": trt_profile.per_patch(patches, 3),
            "group_index": groups["group_index"], "group_mask": groups["group_mask"]}


# --------------------------------------------------------------------------------------------
# The torch module
# --------------------------------------------------------------------------------------------


class MiniCPMVVisionTower(nn.Module):
    """Inputs: `pixel_values` [N, patch_dim] plus `METADATA_INPUTS`; output float32
    [grid rows * query_num, out_hidden]."""
    resampler_class: type[Resampler] = Resampler
    HIDDEN_INPUTS = METADATA_INPUTS[:4]  # the metadata `hidden` takes, in order

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.vpm = nn.Module()
        self.vpm.embeddings = Embeddings(cfg)
        self.vpm.encoder = nn.Module()
        self.vpm.encoder.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg["depth"])])
        self.vpm.post_layernorm = tower_layers.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])
        self.resampler = self.resampler_class(cfg)

    def hidden(self, pixel_values, position_ids, full_index, full_mask, full_inverse):
        """`vpm`'s last hidden state: SigLIP inside each slice or frame."""
        x = self.vpm.embeddings(pixel_values, position_ids)
        full_mask = full_mask.float()
        for layer in self.vpm.encoder.layers:
            x = layer(x, full_index, full_mask, full_inverse, tower_layers.key_lengths(full_mask))
        return self.vpm.post_layernorm(x)

    def forward(self, pixel_values, position_ids, full_index, full_mask, full_inverse, key_positions,
                group_index, group_mask):
        x = self.hidden(pixel_values, position_ids, full_index, full_mask, full_inverse)
        return self.resampler(x, key_positions, group_index, group_mask).float()


class PaddedVisionTower(MiniCPMVVisionTower):
    """2.5's: `vpm` over the padded frames (`padded_metadata`), the resampler over the real patches.
    Inputs: `pixel_values` plus `PADDED_INPUTS`."""

    HIDDEN_INPUTS = PADDED_INPUTS[:6]

    def hidden(self, pixel_values, pixel_index, position_ids, full_index, full_mask, full_inverse, real_rows):
        """`vpm`'s last hidden state of the real patches, each frame run padded with zero pixels."""
        padded = nn.functional.pad(pixel_values, (0, 0, 0, 1)).index_select(0, pixel_index)
        return super().hidden(padded, position_ids, full_index, full_mask, full_inverse).index_select(0, real_rows)

    def forward(self, pixel_values, pixel_index, position_ids, full_index, full_mask, full_inverse, real_rows,
                key_positions, group_index, group_mask):
        x = self.hidden(pixel_values, pixel_index, position_ids, full_index, full_mask, full_inverse, real_rows)
        return self.resampler(x, key_positions, group_index, group_mask).float()


class MiniCPMV4_5VisionTower(MiniCPMVVisionTower):
    """4.5's: the resampler also takes each frame's temporal id."""
    resampler_class = Resampler4_5


class MiniCPMVTower(Tower):
    """2.6's and 4.0's: one group per image slice. Its settings come from the whole `config.json`
    (`query_num` and the resampler's width are at its top level)."""
    module = MiniCPMVVisionTower
    METADATA_INPUTS = METADATA_INPUTS
    METADATA_AXES = {
        "position_ids": {0: "patches"}, "full_index": {0: "frames", 1: "frame_len"},
        "full_mask": {0: "frames", 1: "frame_len"}, "full_inverse": {0: "patches"},
        "key_positions": {0: "patches"}, "group_index": {0: "groups", 1: "group_len"},
        "group_mask": {0: "groups", 1: "group_len"},
    }
    PREFIXES = PREFIXES
    EXAMPLE_GRID = ((1, 6, 10), (1, 8, 8))
    vision_settings = staticmethod(vision_settings)
    encoder_metadata = staticmethod(metadata)
    profile_shapes = staticmethod(profile_shapes)
    WHOLE_CONFIG = True


class MiniCPMV4_5Tower(MiniCPMVTower):
    """4.5's: a grid row may be a video's packed frames, which the resampler takes whole, with
    their temporal ids (`temporal_ids`)."""
    module = MiniCPMV4_5VisionTower
    PACKED_FRAMES = True
    EXTRAS = ("temporal_ids",)

    @classmethod
    def metadata(cls, grid_thw: np.ndarray, settings: dict[str, Any],
                 extras: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        return metadata(grid_thw, settings, (extras or {}).get("temporal_ids"))


def padded_vision_settings(config: Any) -> dict[str, Any]:
    """2.5's `vision_settings` (`Idefics2VisionConfig`'s defaults). Its official code pads the slices
    only in its batched call (`batch_vision_input`, true by default); false, it encodes each slice
    alone (2-D position ids, no padding), which is not implemented: refused, naming the key."""
    if not tower_config.as_dict(config).get("batch_vision_input", True):
        raise NotImplementedError("MiniCPM-V 2.5: batch_vision_input false (each slice encoded alone) is not supported")
    return vision_settings(config, _IDEFICS2_DEFAULTS)


class MiniCPMV2_5Tower(MiniCPMVTower):
    """2.5's: `Idefics2VisionTransformer` (SigLIP-NaViT's weights and layers under Idefics2's config
    defaults), every frame padded to its `padded_patches` (`padded_metadata`)."""
    module = PaddedVisionTower
    METADATA_INPUTS = PADDED_INPUTS
    METADATA_AXES = {**MiniCPMVTower.METADATA_AXES, "pixel_index": {0: "padded"}, "position_ids": {0: "padded"},
                     "full_inverse": {0: "padded"}, "real_rows": {0: "patches"}}
    EXTRAS = ("padded_patches",)
    ROWS = staticmethod(embedding_rows)
    vision_settings = staticmethod(padded_vision_settings)
    encoder_metadata = staticmethod(padded_metadata)

    @classmethod
    def metadata(cls, grid_thw: np.ndarray, settings: dict[str, Any],
                 extras: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        return padded_metadata(grid_thw, settings, (extras or {}).get("padded_patches"))

    @staticmethod
    def profile_shapes(settings: dict[str, Any], patches: tuple[int, int, int]) -> trt_profile.Shapes:
        """As 2.6's, the padded rows' inputs (`pixel_index`, the attention groups) up to twice the
        patches of a run: room for slices padded to about their own size, not for a small slice
        padded to a far larger one (a TensorRT engine of 2.5 is not tested here)."""
        padded = (patches[0], patches[1], 2 * patches[2])
        shapes = profile_shapes(settings, padded)
        return {**shapes, "pixel_values": trt_profile.per_patch(patches, settings["patch_dim"]),
                "pixel_index": trt_profile.per_patch(padded), "real_rows": trt_profile.per_patch(patches),
                "key_positions": trt_profile.per_patch(patches, 3)}
