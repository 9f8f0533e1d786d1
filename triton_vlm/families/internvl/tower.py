"""InternVL's vision side: an export-friendly re-implementation of what transformers'
`InternVLModel.get_image_features` computes (`InternVLVisionModel`, `pixel_shuffle`,
`InternVLMultiModalProjector`).

Input (see `triton_vlm.families.internvl.processor`): `pixel_values` one row per patch in the
Conv2d weight's (C, ph, pw) order, a tile's patches in raster order; `grid_thw` one row [1, S, S]
per tile or video frame, S = `image_size / patch_size` (the position table is learned for exactly
that grid, so every tile has one static shape and a run of B tiles is a [B, S * S, dim] batch:
no host metadata, each tile attends over its own S * S + 1 tokens). Output: per tile S * S / 4
rows, each the projector's output, tiles in order.

Op order, as transformers runs it: the patch embedding (Conv2d with a bias), the class token in
front, the position table (`use_absolute_position_embeddings`); then each layer x + λ1 ∘
Attn(norm(x)), x + λ2 ∘ MLP(norm(x)) (norms LayerNorm or RMSNorm, `norm_type`; q/k/v with or
without biases, `attention_bias`; with `use_qk_norm` q and k RMS-normed over the whole embedding,
eps 1e-6, before the heads split; `projection_layer` with a bias); the final LayerNorm unless
`use_mean_pooling`; the class token dropped ("default"), the (S, S) grid pixel-shuffled by 0.5
(output (r, c) = f[2r, 2c], f[2r, 2c + 1], f[2r + 1, 2c], f[2r + 1, 2c + 1] joined), then
LayerNorm (eps 1e-5), Linear, the projector's activation, Linear. Only the last layer's
features (`vision_feature_layer` -1), "default" and a `downsample_ratio` of 0.5 are implemented;
others are refused naming the key.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn as nn

from triton_vlm.errors import InvalidInput
from triton_vlm.families.llava.tower import LlavaTower
from triton_vlm.vision.tower import attention_groups
from triton_vlm.vision.tower import config as tower_config
from triton_vlm.vision.tower import layers as tower_layers
from triton_vlm.vision.tower.siglip import SiglipMLP

# `InternVLVisionConfig`'s defaults, and `InternVLConfig`'s own fields'.
VISION_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, num_channels=3,
    image_size=448, patch_size=14, hidden_act="gelu", layer_norm_eps=1e-6, attention_bias=False, use_qk_norm=False,
    norm_type="layer_norm", use_mean_pooling=True, use_absolute_position_embeddings=True)
INTERNVL_DEFAULTS: dict[str, Any] = dict(downsample_ratio=0.5, projector_hidden_act="gelu", vision_feature_layer=-1,
                                         vision_feature_select_strategy="default")
NORM_TYPES = ("layer_norm", "rms_norm")
QK_NORM_EPS = 1e-6        # `InternVLVisionRMSNorm`'s default: the q/k norms are built without the config's eps
PROJECTOR_NORM_EPS = 1e-5  # `nn.LayerNorm`'s default
PREFIXES = {"model.vision_tower.": "vision_tower.", "vision_tower.": "vision_tower.",
            "model.multi_modal_projector.": "multi_modal_projector.",
            "multi_modal_projector.": "multi_modal_projector."}


def vision_settings(config: Any) -> dict[str, Any]:
    """An InternVL model config (HF config object or `config.json` dict, the top level) as the
    plain dict of the fields this module uses; what it leaves out, its config classes' defaults."""
    cfg = tower_config.as_dict(config)
    vision = tower_config.as_dict(cfg.get("vision_config") or {})
    text = tower_config.as_dict(cfg.get("text_config") or {})
    if vision.get("model_type", "internvl_vision") != "internvl_vision":
        raise ValueError(f"InternVL: vision_config.model_type {vision['model_type']!r} is not supported "
                         "(internvl_vision)")
    out = {key: vision.get(key, default) for key, default in VISION_DEFAULTS.items()}
    top = {key: cfg.get(key, default) for key, default in INTERNVL_DEFAULTS.items()}
    expected = dict(vision_feature_layer=-1, vision_feature_select_strategy="default", downsample_ratio=0.5)
    for key, value in expected.items():
        if top[key] != value:
            raise ValueError(f"InternVL: {key} {top[key]!r} is not supported (only {value!r})")
    if out["norm_type"] not in NORM_TYPES:
        raise ValueError(f"InternVL: vision_config.norm_type {out['norm_type']!r} is not supported "
                         f"({', '.join(NORM_TYPES)})")
    for key in ("image_size", "patch_size"):
        out[key] = tower_config.square(out[key], key)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels"):
        out[key] = int(out[key])
    side = out["image_size"] // out["patch_size"]
    if side % 2:
        raise ValueError(f"InternVL: image_size / patch_size {side} is odd: the pixel shuffle needs it even")
    out.update(layer_norm_eps=float(out["layer_norm_eps"]), projector_hidden_act=top["projector_hidden_act"],
               out_hidden_size=int(text["hidden_size"]), side=side, spatial_merge_size=2, temporal_patch_size=1,
               num_heads=out["num_attention_heads"], in_channels=out["num_channels"], extra_rows=0)
    return tower_config.add_derived(out)


def encoder_metadata(grid_thw: np.ndarray, settings: dict[str, Any]) -> dict[str, np.ndarray]:
    """None: every tile is the same static [S, S] grid, which is checked here."""
    grid = attention_groups.check_grid(grid_thw, 1)
    side = settings["side"]
    if (grid[:, 1:] != side).any():
        raise InvalidInput(f"grid_thw: InternVL's tower takes tiles of {side} x {side} patches "
                           f"(image_size {settings['image_size']}), got {grid.tolist()}")
    return {}


# --------------------------------------------------------------------------------------------
# Torch tower (parameter names match the Hugging Face state_dict under `model.`)
# --------------------------------------------------------------------------------------------

def _norm(cfg: dict[str, Any], dim: int) -> nn.Module:
    if cfg["norm_type"] == "rms_norm":
        return tower_layers.RMSNorm(dim, cfg["layer_norm_eps"])
    return tower_layers.LayerNorm(dim, eps=cfg["layer_norm_eps"])


class Attention(nn.Module):
    """Separate q / k / v (biases per `attention_bias`), optional q / k RMSNorm over the whole
    embedding, `projection_layer`; attention inside each run of `length` adjacent rows."""
    fused = True  # see tower_layers.VisionAttention

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim, bias = cfg["hidden_size"], cfg["attention_bias"]
        self.num_heads = cfg["num_heads"]
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=bias) for _ in range(3))
        self.projection_layer = nn.Linear(dim, dim)
        self.qk_norm = bool(cfg["use_qk_norm"])
        if self.qk_norm:
            self.q_norm, self.k_norm = tower_layers.RMSNorm(dim, QK_NORM_EPS), tower_layers.RMSNorm(dim, QK_NORM_EPS)

    def forward(self, x: torch.Tensor, length: int) -> torch.Tensor:
        n, dim = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.reshape(n // length, length, dim) for t in (q, k, v))
        out = tower_layers.attention(q, k, v, None, None, self.num_heads, self.fused)
        return self.projection_layer(out.reshape(n, dim))


class Layer(nn.Module):
    """x + λ1 ∘ Attn(norm(x)), then x + λ2 ∘ MLP(norm(x)), over the float32 residual stream."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim = cfg["hidden_size"]
        self.attention = Attention(cfg)
        self.mlp = SiglipMLP(cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_act"])
        self.layernorm_before, self.layernorm_after = _norm(cfg, dim), _norm(cfg, dim)
        self.lambda_1, self.lambda_2 = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, length: int) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x), length)
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class Embeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        p, dim = cfg["patch_size"], cfg["hidden_size"]
        self.patches = cfg["side"] ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.patch_embeddings = nn.Module()
        self.patch_embeddings.projection = nn.Conv2d(cfg["in_channels"], dim, kernel_size=p, stride=p)
        if cfg["use_absolute_position_embeddings"]:
            self.position_embeddings = nn.Parameter(torch.zeros(1, self.patches + 1, dim))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, patch_dim] -> [N / S^2 * (S^2 + 1), dim], the class token first in each tile."""
        x = tower_layers.residual_stream(tower_layers.patch_linear(pixel_values, self.patch_embeddings.projection))
        dim = x.shape[1]
        x = x.reshape(-1, self.patches, dim)
        x = torch.cat([self.cls_token.float().expand(x.shape[0], 1, dim), x], dim=1)
        if hasattr(self, "position_embeddings"):
            x = x + self.position_embeddings.float()
        return x.reshape(-1, dim)


class Projector(nn.Module):
    """`InternVLMultiModalProjector`: LayerNorm, linear_1, the projector's activation, linear_2."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        joined, out = cfg["hidden_size"] * 4, cfg["out_hidden_size"]
        self.layer_norm = tower_layers.LayerNorm(joined, eps=PROJECTOR_NORM_EPS)
        self.linear_1, self.linear_2 = nn.Linear(joined, out), nn.Linear(out, out)
        self.act = tower_layers.activation(cfg["projector_hidden_act"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


def pixel_shuffle(features: torch.Tensor, side: int) -> torch.Tensor:
    """[tiles, S * S, C] -> [tiles * (S / 2)^2, 4C]: transformers' `pixel_shuffle(0.5)`."""
    tiles, _, channels = features.shape
    half = side // 2
    x = features.reshape(tiles, half, 2, half, 2, channels).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(tiles * half * half, 4 * channels)


class InternVLVisionTower(nn.Module):
    """Input `pixel_values` [N, patch_dim] (N a multiple of S^2); output float32 [N / 4, out_hidden]."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.side = cfg["side"]
        self.vision_tower = model = nn.Module()
        model.embeddings = Embeddings(cfg)
        model.encoder = nn.Module()
        model.encoder.layer = nn.ModuleList([Layer(cfg) for _ in range(cfg["num_hidden_layers"])])
        if not cfg["use_mean_pooling"]:
            model.layernorm = tower_layers.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])
        self.multi_modal_projector = Projector(cfg)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        model, tokens = self.vision_tower, self.side ** 2 + 1
        x = model.embeddings(pixel_values)
        for layer in model.encoder.layer:
            x = layer(x, tokens)
        if hasattr(model, "layernorm"):
            x = model.layernorm(x)
        dim = x.shape[1]
        features = x.reshape(-1, tokens, dim)[:, 1:]
        return self.multi_modal_projector(pixel_shuffle(features, self.side)).float()


class InternVLTower(LlavaTower):
    """LLaVA's tower mechanics (whole static tiles, no metadata; settings from the whole
    `config.json`), InternViT's module. Only the weights the outputs use are loaded (a
    `mask_token`, where a checkpoint has one, is left in it)."""
    module = InternVLVisionTower
    PREFIXES = PREFIXES
    vision_settings = staticmethod(vision_settings)
    encoder_metadata = staticmethod(encoder_metadata)
