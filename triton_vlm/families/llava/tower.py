"""LLaVA's vision side (`llava`): an export-friendly re-implementation of what transformers'
`LlavaModel.get_image_features` computes: the CLIP or SigLIP vision tower's hidden states of
`vision_feature_layer`, the feature select strategy, and `LlavaMultiModalProjector`.

Input convention (see `triton_vlm.families.llava`): `pixel_values` has one row per patch, its
values in the patch-embedding Conv2d weight's (C, ph, pw) order, an image's patches in raster
order; `grid_thw` one row `[1, S, S]` per image, S = `image_size / patch_size`: the towers have
learned position embeddings for exactly that grid, so every image has the same static shape and
a run of B images is a [B, S * S, dim] batch (no host metadata, no padding, no attention groups:
each image attends over its own S * S (+ 1) tokens). Output: per image its S * S tokens (with
CLIP's class token first), less the first with the "default" strategy, each the projector's
output; images in order.

Op order, as transformers runs it: the patch embedding (Conv2d; SigLIP's with a bias), CLIP's
class embedding in front, the position embeddings, CLIP's `pre_layrnorm`; then the encoder
layers (LayerNorm, attention with q/k/v/out biases, LayerNorm, MLP: fc1, the tower's
activation, fc2). `hidden_states[0]` is the encoder's input and `hidden_states[k]` layer k's
output; the last is taken before `post_layernorm` (which, like SigLIP's pooling head, plays no
part: transformers' `hidden_states` are captured without it). Negative layer indices count from
the end (-1: the last layer), as in transformers; only layers up to the deepest selected one run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from triton_vlm.errors import InvalidInput
from triton_vlm.families.minicpmv import tower_v4_6 as minicpmv
from triton_vlm.vision.tower import attention_groups
from triton_vlm.vision.tower import config as tower_config
from triton_vlm.vision.tower import layers as tower_layers
from triton_vlm.vision.tower import trt_profile
from triton_vlm.vision.tower.base import Tower


@dataclass(frozen=True)
class TowerKind:
    """What a `vision_config.model_type` brings, and its config class's defaults."""
    class_token: bool   # a learned class embedding in front of the patches (CLIP)
    pre_norm: bool      # `pre_layrnorm` before the encoder (CLIP)
    patch_bias: bool    # the patch-embedding Conv2d has a bias (SigLIP)
    defaults: dict[str, Any]


_COMMON = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
               num_channels=3, image_size=224)
TOWER_KINDS: dict[str, TowerKind] = {
    "clip_vision_model": TowerKind(True, True, False, dict(_COMMON, patch_size=32, hidden_act="quick_gelu",
                                                           layer_norm_eps=1e-5)),
    "siglip_vision_model": TowerKind(False, False, True, dict(_COMMON, patch_size=16, hidden_act="gelu_pytorch_tanh",
                                                              layer_norm_eps=1e-6)),
}
# `LlavaConfig`'s own fields and their defaults (with its tower's `model_type`, where its
# `vision_config` names none).
LLAVA_DEFAULTS: dict[str, Any] = dict(vision_feature_layer=-2, vision_feature_select_strategy="default",
                                      projector_hidden_act="gelu", multimodal_projector_bias=True,
                                      vision_model_type="clip_vision_model")
# transformers 5 saves the tower's weights as `vision_tower.embeddings...`, 4.x as
# `vision_tower.vision_model.embeddings...` (longer prefixes first: the first match renames).
PREFIXES = {"model.vision_tower.vision_model.": "vision_tower.", "vision_tower.vision_model.": "vision_tower.",
            "model.vision_tower.": "vision_tower.", "vision_tower.": "vision_tower.",
            "model.multi_modal_projector.": "multi_modal_projector.",
            "multi_modal_projector.": "multi_modal_projector."}


def vision_settings(config: Any, defaults: dict[str, Any] = LLAVA_DEFAULTS) -> dict[str, Any]:
    """A LLaVA model config (HF config object or `config.json` dict: the top level, which holds the
    feature selection and projector fields, with `vision_config` and `text_config` inside) as a
    plain JSON-able dict of the fields this module uses; `defaults`: its config class's."""
    cfg = tower_config.as_dict(config)
    vision = tower_config.as_dict(cfg.get("vision_config") or {})
    text = tower_config.as_dict(cfg.get("text_config") or {})
    model_type = vision.get("model_type", defaults["vision_model_type"])
    if model_type not in TOWER_KINDS:
        raise ValueError(f"LLaVA: vision_config.model_type {model_type!r} is not supported; "
                         f"supported: {', '.join(TOWER_KINDS)}")
    kind = TOWER_KINDS[model_type]
    out = {key: vision.get(key, default) for key, default in kind.defaults.items()}
    out.update({key: cfg.get(key, default) for key, default in defaults.items() if key != "vision_model_type"})
    for key in ("image_size", "patch_size"):
        out[key] = tower_config.square(out[key], key)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels"):
        out[key] = int(out[key])
    out["layer_norm_eps"] = float(out["layer_norm_eps"])
    strategy = out["vision_feature_select_strategy"]
    if strategy not in ("default", "full"):
        raise ValueError(f"LLaVA: vision_feature_select_strategy {strategy!r} is not supported (default, full)")
    layers = out.pop("vision_feature_layer")
    out["feature_layers"] = [_layer_index(int(i), out["num_hidden_layers"])
                             for i in (layers if isinstance(layers, (list, tuple)) else [layers])]
    out.update(vision_model_type=model_type, class_token=kind.class_token, pre_norm=kind.pre_norm,
               patch_bias=kind.patch_bias, multimodal_projector_bias=bool(out["multimodal_projector_bias"]),
               out_hidden_size=int(text["hidden_size"]), side=out["image_size"] // out["patch_size"],
               # rows per image beyond one per patch: the class token kept, the first token dropped
               extra_rows=int(kind.class_token) - int(strategy == "default"),
               spatial_merge_size=1, temporal_patch_size=1, num_heads=out["num_attention_heads"],
               in_channels=out["num_channels"])
    return tower_config.add_derived(out)


def _layer_index(index: int, num_layers: int) -> int:
    """A `hidden_states` index (0: the encoder's input, k: layer k's output, negative: from the end)
    as a non-negative one."""
    resolved = index + num_layers + 1 if index < 0 else index
    if not 0 <= resolved <= num_layers:
        raise ValueError(f"LLaVA: vision_feature_layer {index} is out of range for {num_layers} layers")
    return resolved


def patch_rows(pixel_values: Any, patch_size: int) -> np.ndarray:
    """transformers' `pixel_values` [B, C, H, W] as this tower's rows [B * (H // p) * (W // p), C * p * p]
    (the patch embedding's stride leaves out what is past the last whole patch)."""
    p = patch_size
    x = np.asarray(pixel_values)
    x = x[:, :, :x.shape[2] // p * p, :x.shape[3] // p * p]
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(x.reshape(-1, c * p * p))


def encoder_metadata(grid_thw: np.ndarray, settings: dict[str, Any]) -> dict[str, np.ndarray]:
    """None: every image is the same static [S, S] grid, which is checked here."""
    grid = attention_groups.check_grid(grid_thw, 1)
    side = settings["side"]
    if (grid[:, 1:] != side).any():
        raise InvalidInput(f"grid_thw: LLaVA's tower takes images of {side} x {side} patches "
                           f"(image_size {settings['image_size']}), got {grid.tolist()}")
    return {}


def profile_shapes(settings: dict[str, Any], patches: tuple[int, int, int]) -> trt_profile.Shapes:
    """TensorRT (min, opt, max) shape of `pixel_values`: whole images of S * S patches each."""
    image = settings["side"] ** 2
    rows = tuple(max(image, p // image * image) for p in patches)
    return {"pixel_values": trt_profile.per_patch(rows, settings["patch_dim"])}


# --------------------------------------------------------------------------------------------
# Torch tower (parameter names match the Hugging Face state_dict under `model.`)
# --------------------------------------------------------------------------------------------

class EncoderLayer(minicpmv.EncoderLayer):
    """CLIP's / SigLIP's encoder layer (MiniCPM-V's SigLIP layer, the same weights) over runs of
    `length` adjacent rows (one image each)."""

    def forward(self, x: torch.Tensor, length: int) -> torch.Tensor:
        x = x + self.self_attn.windows(self.layer_norm1(x), length)
        return x + self.mlp(self.layer_norm2(x))


class Embeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        p, dim = cfg["patch_size"], cfg["hidden_size"]
        self.patches, self.class_token = cfg["side"] ** 2, cfg["class_token"]
        self.patch_embedding = nn.Conv2d(cfg["in_channels"], dim, kernel_size=p, stride=p, bias=cfg["patch_bias"])
        if self.class_token:
            self.class_embedding = nn.Parameter(torch.zeros(dim))
        self.position_embedding = nn.Embedding(self.patches + self.class_token, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, patch_dim] -> [N / S^2 * tokens, dim] (tokens: S^2, plus the class token), the float32
        residual stream."""
        x = tower_layers.residual_stream(tower_layers.patch_linear(pixel_values, self.patch_embedding))
        dim = x.shape[1]
        x = x.reshape(-1, self.patches, dim)
        if self.class_token:
            x = torch.cat([self.class_embedding.float().expand(x.shape[0], 1, dim), x], dim=1)
        return (x + self.position_embedding.weight.float()).reshape(-1, dim)


class Projector(nn.Module):
    """`LlavaMultiModalProjector`: linear_1, the projector's activation, linear_2."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        joined, out, bias = cfg["hidden_size"] * len(cfg["feature_layers"]), cfg["out_hidden_size"], \
            cfg["multimodal_projector_bias"]
        self.linear_1 = nn.Linear(joined, out, bias=bias)
        self.act = tower_layers.activation(cfg["projector_hidden_act"])
        self.linear_2 = nn.Linear(out, out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x.to(self.linear_1.weight.dtype))))


class LlavaVisionTower(nn.Module):
    """Input `pixel_values` [N, patch_dim] (N a multiple of S^2); output float32
    [images * (S^2 + extra_rows), out_hidden]."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.feature_layers = list(cfg["feature_layers"])
        self.drop_first = cfg["vision_feature_select_strategy"] == "default"
        self.vision_tower = model = nn.Module()
        model.embeddings = Embeddings(cfg)
        if cfg["pre_norm"]:
            model.pre_layrnorm = tower_layers.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])
        model.encoder = nn.Module()
        model.encoder.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(max(self.feature_layers))])
        self.multi_modal_projector = Projector(cfg)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        model = self.vision_tower
        x = model.embeddings(pixel_values)
        if hasattr(model, "pre_layrnorm"):
            x = model.pre_layrnorm(x).float()
        tokens = model.embeddings.position_embedding.num_embeddings
        hidden = [x]
        for layer in model.encoder.layers:
            hidden.append(layer(hidden[-1], tokens))
        dim = x.shape[1]
        pool = [hidden[i].reshape(-1, tokens, dim)[:, int(self.drop_first):] for i in self.feature_layers]
        features = torch.cat(pool, dim=-1) if len(pool) > 1 else pool[0]
        out = self.multi_modal_projector(features)
        return out.reshape(-1, out.shape[-1]).float()


class LlavaTower(Tower):
    """Its settings come from the whole `config.json` (the feature selection and projector fields
    are at its top level). Only the weights the outputs use are loaded: layers past the deepest
    selected one, `post_layernorm` and SigLIP's pooling head are left in the checkpoint."""
    module = LlavaVisionTower
    METADATA_INPUTS = ()
    METADATA_AXES: dict[str, dict[int, str]] = {}
    PREFIXES = PREFIXES
    WHOLE_CONFIG = True
    vision_settings = staticmethod(vision_settings)
    encoder_metadata = staticmethod(encoder_metadata)
    profile_shapes = staticmethod(profile_shapes)

    @classmethod
    def example_inputs(cls, settings: dict[str, Any], grid_thw=None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Two images of the checkpoint's S x S (the export's trace: a batch dimension that varies)."""
        side = settings["side"]
        return attention_groups.example_inputs(settings, cls.encoder_metadata, grid_thw or ((1, side, side),) * 2)

    @classmethod
    def warmup_grid(cls, settings: dict[str, Any], min_patches: int = 1) -> np.ndarray:
        """Whole S x S images, as many as `min_patches` needs, as one item of several frames."""
        side, images = settings["side"], 1
        while images * side * side < min_patches:
            images += 1
        return np.array([[images, side, side]], dtype=np.int64)

    @classmethod
    def load_tower(cls, checkpoint_dir, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The torch tower with the checkpoint's weights of every one of its parameters (strictly);
        the checkpoint's others are not used."""
        tower = cls.module(cls.read_vision_config(checkpoint_dir))
        wanted = set(tower.state_dict())
        state = {k: v for k, v in tower_config.load_state_dict(checkpoint_dir, cls.PREFIXES).items() if k in wanted}
        tower.load_state_dict(state, strict=True)
        return tower.to(dtype).eval()
