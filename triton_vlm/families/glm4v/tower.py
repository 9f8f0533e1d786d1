"""GLM-4.1V vision tower (`glm4v_vision`, shared by GLM-4.1V, GLM-4.6V-Flash and GLMGA): an
export-friendly re-implementation of transformers' `Glm4vVisionModel` plus its host-side metadata.

Op order, as transformers runs it: Conv3d patch embedding (with bias), RMSNorm
(`post_conv_layernorm`), plus the learned position embeddings (a square grid of
image_size / patch_size per side) resampled to each image's h x w patch grid with bicubic
`grid_sample` (border padding, align_corners False); blocks (RMSNorm, attention over each frame
with 2-D rotary, RMSNorm, SwiGLU MLP); RMSNorm (`post_layernorm`); the 2x2 merge as a Conv2d
(`downsample`); the merger (Linear, LayerNorm, GELU, SwiGLU).

Patches stay in the processor's order (frame, merge-block row, merge-block column, 2x2 patches
of the block), so the four patches a `downsample` merges are adjacent rows. The host computes
(see `triton_vlm.vision.tower.attention_groups`) the rotary tables, the per-frame attention groups (`full_*`,
i.e. `cu_seqlens`) and `pos_grid` float32 [N, 2]: each patch's (x, y) sample point in [-1, 1]
for the position-embedding resampling, ((w + 0.5) / W) * 2 - 1 and the same for h, in float32
as transformers forms it. The resampling itself is in the graph (ONNX `GridSample`, bicubic,
border), so any patch grid works, larger or smaller than the embedding grid.

GLM-OCR's tower (`GlmOcrTower`, transformers' `GlmOcrVisionModel`) is the same without the
post-conv RMSNorm and the position embeddings (so no `pos_grid`), with q and k RMS-normed per head
before the rotary, `attention_bias` on the attention output and block MLP projections too, block
MLPs `intermediate_size` wide, and a merger whose SwiGLU is `out_hidden_size * in_channels` wide
(transformers' sizing; vLLM uses the text `intermediate_size`).

Videos: every temporal step is encoded as its own frame with its item's (h, w), as transformers'
`get_video_features` does (it flattens `video_grid_thw` to one row per step before the tower).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn as nn

from triton_vlm.vision.tower import attention_groups
from triton_vlm.vision.tower import config as tower_config
from triton_vlm.vision.tower import layers as tower_layers
from triton_vlm.vision.tower import trt_profile
from triton_vlm.vision.tower.base import Tower

# The vision-config fields the tower and its metadata read, with Hugging Face's defaults
# (`Glm4vVisionConfig`).
_DEFAULTS: dict[str, Any] = dict(
    depth=24, hidden_size=1536, hidden_act="silu", attention_bias=False, num_heads=12, in_channels=3,
    image_size=336, patch_size=14, rms_norm_eps=1e-5, spatial_merge_size=2, temporal_patch_size=2,
    out_hidden_size=4096, intermediate_size=13696, rope_theta=10000.0,
)
# `GlmOcrVisionConfig`'s own defaults on top.
_OCR_DEFAULTS: dict[str, Any] = {**_DEFAULTS, **dict(hidden_size=1024, attention_bias=True, num_heads=16,
                                                      out_hidden_size=1536, intermediate_size=4096)}


def vision_settings(vision_config: Any, defaults: dict[str, Any] = _DEFAULTS) -> dict[str, Any]:
    """Normalise a vision config (HF config object or dict, e.g. `config.json`'s `vision_config`)
    into a plain JSON-able dict of the fields this module uses."""
    out = tower_config.config_fields(vision_config, defaults)
    for key in ("image_size", "patch_size", "temporal_patch_size"):
        out[key] = tower_config.square(out[key], key)
    for key in ("depth", "hidden_size", "num_heads", "in_channels", "spatial_merge_size", "out_hidden_size",
                "intermediate_size"):
        out[key] = int(out[key])
    out["attention_bias"] = bool(out["attention_bias"])
    out["rms_norm_eps"] = float(out["rms_norm_eps"])
    out["pos_embed_size"] = out["image_size"] // out["patch_size"]  # position-embedding grid side
    return tower_config.add_derived(out)



# --------------------------------------------------------------------------------------------
# Host-side metadata (numpy)
# --------------------------------------------------------------------------------------------

def _frame_layout(h: int, w: int, m: int, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One frame of an h x w patch grid, processor order: rotary cos / sin [h*w, head_dim] and the
    position-embedding sample points [h*w, 2] (x from the column, y from the row)."""
    hpos, wpos = attention_groups.patch_positions(h, w, m)
    cos, sin = attention_groups.rotary_tables(hpos, wpos, inv_freq)
    half, two, one = np.float32(0.5), np.float32(2.0), np.float32(1.0)
    x = (wpos.astype(np.float32) + half) / np.float32(w) * two - one
    y = (hpos.astype(np.float32) + half) / np.float32(h) * two - one
    return cos, sin, np.stack([x, y], axis=1)


def encoder_metadata(grid_thw: np.ndarray, settings: dict[str, Any]) -> dict[str, np.ndarray]:
    """The tower's metadata inputs for `grid_thw` [M, 3] (processor order), computed with numpy.

    Keys: `Glm4vTower.METADATA_INPUTS`. Requires at least one item."""
    m = settings["spatial_merge_size"]
    grid = attention_groups.check_grid(grid_thw, m)
    inv_freq = attention_groups.rotary_inv_freq(settings["head_dim"], settings["rope_theta"])
    cos, sin, pos = attention_groups.per_frame_tables(grid, lambda h, w: _frame_layout(h, w, m, inv_freq))
    return dict(rotary_cos=cos, rotary_sin=sin, pos_grid=pos, **attention_groups.frame_groups(grid))


def profile_shapes(settings: dict[str, Any], patches: tuple[int, int, int]) -> trt_profile.Shapes:
    """TensorRT (min, opt, max) shape of every input for runs of `patches` (min, opt, max) rows."""
    return {**trt_profile.frame_profile(settings, patches), "pos_grid": trt_profile.per_patch(patches, 2)}


# --------------------------------------------------------------------------------------------
# Torch tower (parameter names match the Hugging Face state_dict under `visual.`)
# --------------------------------------------------------------------------------------------

class PositionEmbedding(nn.Module):
    """Learned embeddings on a side x side grid, resampled bicubically at each patch's sample point."""

    def __init__(self, side: int, dim: int):
        super().__init__()
        self.side = side
        self.position_embedding = nn.Embedding(side * side, dim)

    def forward(self, x: torch.Tensor, pos_grid: torch.Tensor) -> torch.Tensor:
        weight = self.position_embedding.weight
        # transformers resamples in float32 whatever the model dtype (and so must ORT's GridSample).
        table = weight.float().reshape(self.side, self.side, -1).permute(2, 0, 1).unsqueeze(0)
        sampled = nn.functional.grid_sample(table, pos_grid.float()[None, :, None, :], mode="bicubic",
                                            padding_mode="border", align_corners=False)  # [1, C, N, 1]
        return tower_layers.residual_stream(x) + sampled[0, :, :, 0].t()


class PatchMerger(tower_layers.VisionMLP):
    """proj -> LayerNorm -> GELU -> SwiGLU (gate / up / down)."""

    def __init__(self, dim: int, context: int, act: str):
        super().__init__(dim, context, act, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = tower_layers.LayerNorm(dim)
        self.act1 = nn.GELU()

    def forward(self, x):
        return super().forward(self.act1(self.post_projection_norm(self.proj(x))))


class _GlmVisionTower(nn.Module):
    """What both GLM towers share: the patch embedding, the blocks (MLPs `mlp_hidden` wide), the
    post-layernorm, the 2x2 `downsample` and the merger (`merger_context` wide)."""

    def __init__(self, cfg: dict[str, Any], *, mlp_hidden: int, bias: bool, qk_norm: bool, merger_context: int):
        """`bias`: the attention output and MLP projections have biases (qkv's: `attention_bias`)."""
        super().__init__()
        dim, m, eps = cfg["hidden_size"], cfg["spatial_merge_size"], cfg["rms_norm_eps"]
        self.patch_embed = tower_layers.PatchEmbed(cfg, bias=True)
        self.blocks = nn.ModuleList([
            tower_layers.VisionBlock(dim, cfg["num_heads"], mlp_hidden, cfg["hidden_act"], eps,
                               qkv_bias=cfg["attention_bias"], proj_bias=bias, mlp_bias=bias, qk_norm=qk_norm)
            for _ in range(cfg["depth"])])
        self.post_layernorm = tower_layers.RMSNorm(dim, eps)
        self.downsample = nn.Conv2d(dim, cfg["out_hidden_size"], kernel_size=m, stride=m)
        self.merger = PatchMerger(cfg["out_hidden_size"], merger_context, cfg["hidden_act"])

    def _downsample(self, x: torch.Tensor) -> torch.Tensor:
        """The m x m Conv2d over each merge block's adjacent rows as one MatMul: rows [N/m^2, m*m*C]
        in (i, j, channel) order against the weight permuted to the same order."""
        weight = self.downsample.weight  # [out, C, m, m]
        flat = weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1)
        return nn.functional.linear(x.reshape(-1, flat.shape[1]), flat, self.downsample.bias)

    def encode(self, x, rotary_cos, rotary_sin, full_index, full_mask, full_inverse) -> torch.Tensor:
        """The blocks onward, from the embedded patches x [N, hidden]."""
        cos, sin = rotary_cos.float()[:, None, None, :], rotary_sin.float()[:, None, None, :]
        full_mask = full_mask.float()
        full_len = tower_layers.key_lengths(full_mask)
        for block in self.blocks:
            x = block(x, cos, sin, full_index, full_mask, full_inverse, full_len)
        x = self._downsample(self.post_layernorm(x))
        return self.merger(x).float()


class Glm4vVisionTower(_GlmVisionTower):
    """Inputs: `pixel_values` [N, patch_dim] plus `Glm4vTower.METADATA_INPUTS`; output float32
    [N / merge^2, out_hidden]."""

    def __init__(self, cfg: dict[str, Any]):
        # The block MLP is out_hidden_size wide, the merger's intermediate_size (as in transformers).
        super().__init__(cfg, mlp_hidden=cfg["out_hidden_size"], bias=False, qk_norm=False,
                         merger_context=cfg["intermediate_size"])
        self.post_conv_layernorm = tower_layers.RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.embeddings = PositionEmbedding(cfg["pos_embed_size"], cfg["hidden_size"])

    def forward(self, pixel_values, rotary_cos, rotary_sin, pos_grid, full_index, full_mask, full_inverse):
        x = self.embeddings(self.post_conv_layernorm(self.patch_embed(pixel_values)), pos_grid)
        return self.encode(x, rotary_cos, rotary_sin, full_index, full_mask, full_inverse)


class GlmOcrVisionTower(_GlmVisionTower):
    """GLM-OCR: inputs `pixel_values` [N, patch_dim] plus `GlmOcrTower.METADATA_INPUTS`."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg, mlp_hidden=cfg["intermediate_size"], bias=cfg["attention_bias"], qk_norm=True,
                         merger_context=cfg["out_hidden_size"] * cfg["in_channels"])

    def forward(self, pixel_values, rotary_cos, rotary_sin, full_index, full_mask, full_inverse):
        return self.encode(tower_layers.residual_stream(self.patch_embed(pixel_values)), rotary_cos, rotary_sin, full_index, full_mask,
                           full_inverse)


class Glm4vTower(Tower):
    module = Glm4vVisionTower
    METADATA_INPUTS = attention_groups.ROTARY_INPUTS + ("pos_grid",) + attention_groups.FULL_INPUTS
    METADATA_AXES = {**attention_groups.FRAME_AXES, "pos_grid": {0: "patches"}}
    vision_settings = staticmethod(vision_settings)
    encoder_metadata = staticmethod(encoder_metadata)
    profile_shapes = staticmethod(profile_shapes)


class GlmOcrTower(Tower):
    """GLM-4.1V's metadata less `pos_grid`."""
    module = GlmOcrVisionTower
    METADATA_INPUTS = attention_groups.ROTARY_INPUTS + attention_groups.FULL_INPUTS
    METADATA_AXES = attention_groups.FRAME_AXES

    @staticmethod
    def vision_settings(vision_config: Any) -> dict[str, Any]:
        return vision_settings(vision_config, _OCR_DEFAULTS)

    @classmethod
    def encoder_metadata(cls, grid_thw: np.ndarray, settings: dict[str, Any]) -> dict[str, np.ndarray]:
        metadata = encoder_metadata(grid_thw, settings)
        return {name: metadata[name] for name in cls.METADATA_INPUTS}

    @classmethod
    def profile_shapes(cls, settings: dict[str, Any], patches: tuple[int, int, int]) -> trt_profile.Shapes:
        return trt_profile.frame_profile(settings, patches)
