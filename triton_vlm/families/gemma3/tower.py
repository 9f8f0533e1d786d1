"""Gemma 3's vision side: an export-friendly re-implementation of `Gemma3Model.get_image_features`:
the SigLIP tower's `last_hidden_state` (every encoder layer, then `post_layernorm`), each view's
S x S patch features average-pooled to sqrt(mm_tokens_per_image) a side (`Gemma3MultiModalProjector`:
`AvgPool2d`, row-major tokens), the (1 + w) RMSNorm `mm_soft_emb_norm` (float32, the vision eps) and
the `mm_input_projection_weight` product.

Input convention (`triton_vlm.families.gemma3.processor`): `pixel_values` one row per patch, (C, ph,
pw) order, a view's patches in raster order; `grid_thw` one row `[1, S, S]` per view (the whole
image and each pan-and-scan crop). Every view has the tower's static S x S grid, so a run of B
views is one [B, S * S, dim] batch (no metadata); each gives `mm_tokens_per_image` rows.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from triton_vlm.families.gemma3 import processor
from triton_vlm.families.llava import tower as llava
from triton_vlm.vision.tower import config as tower_config
from triton_vlm.vision.tower import layers as tower_layers

# `Gemma3Config`'s own fields as the LLaVA settings reader takes them: the last layer's features,
# every token, a SigLIP tower where `vision_config` names none.
GEMMA3_DEFAULTS: dict[str, Any] = dict(llava.LLAVA_DEFAULTS, vision_feature_layer=-1,
                                       vision_feature_select_strategy="full", vision_model_type="siglip_vision_model")


def vision_settings(config: Any) -> dict[str, Any]:
    """A Gemma 3 model config (object or `config.json` dict) as the tower's settings: SigLIP's, the
    pooled tokens per view (`mm_tokens_per_image`, a square no larger than the patch grid that divides it)."""
    cfg = tower_config.as_dict(config)
    out = llava.vision_settings(cfg, GEMMA3_DEFAULTS)
    if out["vision_model_type"] != "siglip_vision_model":
        raise ValueError(f"Gemma 3: vision_config.model_type {out['vision_model_type']!r} is not supported")
    tokens = int(cfg.get("mm_tokens_per_image", 256))
    pooled = math.isqrt(tokens)
    if pooled * pooled != tokens or out["side"] % pooled:
        raise ValueError(f"Gemma 3: mm_tokens_per_image {tokens} does not pool a {out['side']} x {out['side']} "
                         "patch grid")
    out.update(mm_tokens_per_image=tokens, pool=out["side"] // pooled, extra_rows=0)
    return out


class Projector(nn.Module):
    """`Gemma3MultiModalProjector` after the pooling: (1 + w) RMSNorm in float32, then the projection."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.zeros(cfg["hidden_size"]))
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(cfg["hidden_size"], cfg["out_hidden_size"]))
        self.eps = cfg["layer_norm_eps"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (normed * (1.0 + self.mm_soft_emb_norm.weight.float())).to(self.mm_input_projection_weight.dtype)
        return torch.matmul(normed, self.mm_input_projection_weight)


class Gemma3VisionTower(nn.Module):
    """Input `pixel_values` [N, patch_dim] (N a multiple of S^2); output float32 [views * tokens, out_hidden]."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.side, self.pool = cfg["side"], cfg["pool"]
        self.vision_tower = model = nn.Module()
        model.embeddings = llava.Embeddings(cfg)
        model.encoder = nn.Module()
        model.encoder.layers = nn.ModuleList([llava.EncoderLayer(cfg) for _ in range(cfg["num_hidden_layers"])])
        model.post_layernorm = tower_layers.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])
        self.multi_modal_projector = Projector(cfg)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        model, s = self.vision_tower, self.side
        x = model.embeddings(pixel_values)
        for layer in model.encoder.layers:
            x = layer(x, s * s)
        x = model.post_layernorm(x)
        dim = x.shape[1]
        grid = x.reshape(-1, s, s, dim).permute(0, 3, 1, 2)
        pooled = nn.functional.avg_pool2d(grid.float(), self.pool, self.pool).flatten(2).transpose(1, 2)
        out = self.multi_modal_projector(pooled.to(x.dtype))
        return out.reshape(-1, out.shape[-1]).float()


class Gemma3Tower(llava.LlavaTower):
    """LLaVA's loading, checks and shapes (whole S x S views), Gemma 3's module and rows."""
    module = Gemma3VisionTower
    ROWS = staticmethod(processor.embedding_rows)
    vision_settings = staticmethod(vision_settings)
