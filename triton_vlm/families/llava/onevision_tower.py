"""LLaVA-OneVision's vision side (`llava_onevision`): LLaVA's SigLIP tower and projector
(`triton_vlm.families.llava.tower`) for every view, then what transformers' `pack_image_features` and
`get_video_features` make of the views' features, as one gather: each output row is a weighted
sum of at most four rows of [the run's view features; `image_newline`] (`feature_index`,
`feature_weight`, computed on the host from the grid and each row's image size:
`triton_vlm.families.llava.anyres`).
That one op is the unpadding and the tiles' canvas (a gather), the "anyres_max" cut and a
video frame's 2 x 2 pooling (bilinear: four taps, torch's `interpolate(mode="bilinear")`
weights) and the newlines, so the ONNX graph has no data-dependent shapes.

Each grid row is one item, taken whole (`PACKED_FRAMES`): [views, S, S] with an image's size
(height, width), or a video's frames with (0, 0) (`image_sizes`, one row per grid row; see
`triton_vlm.families.llava.onevision`).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from triton_vlm.families.llava import tower as llava
from triton_vlm.families.llava.anyres import embedding_rows, feature_plan
from triton_vlm.families.llava.onevision import DEFAULT_PINPOINTS
from triton_vlm.families.llava.tower import LlavaTower, LlavaVisionTower
from triton_vlm.vision.tower import config as tower_config
from triton_vlm.vision.tower import trt_profile

PREFIXES = {**llava.PREFIXES, "model.image_newline": "image_newline", "image_newline": "image_newline"}
# `LlavaOnevisionConfig`'s defaults: the last layer's features, all of them, a SigLIP tower.
DEFAULTS = {**llava.LLAVA_DEFAULTS, "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
            "vision_model_type": "siglip_vision_model"}


def vision_settings(config: Any) -> dict[str, Any]:
    """LLaVA's settings of a OneVision config, with its pinpoints and `vision_aspect_ratio`."""
    cfg = tower_config.as_dict(config)
    out = llava.vision_settings(cfg, DEFAULTS)
    if out["vision_model_type"] != "siglip_vision_model" or out["vision_feature_select_strategy"] != "full":
        raise ValueError("LLaVA-OneVision: only a SigLIP tower with vision_feature_select_strategy 'full' is supported")
    pinpoints = cfg.get("image_grid_pinpoints") or DEFAULT_PINPOINTS
    out.update(image_grid_pinpoints=[[int(h), int(w)] for h, w in pinpoints],
               vision_aspect_ratio=str(cfg.get("vision_aspect_ratio", "anyres_max_9")))
    return out


def profile_shapes(settings: dict[str, Any], patches: tuple[int, int, int]) -> trt_profile.Shapes:
    """TensorRT (min, opt, max) shapes: LLaVA's whole views of `pixel_values`, and the gather's rows,
    at most one per patch, one newline per S patches (a canvas row) and one per item."""
    shapes = llava.profile_shapes(settings, patches)
    side = settings["side"]
    (_, opt, most) = (p for p, _ in shapes["pixel_values"])
    rows = (1, opt + 2 * (opt // side), most + 2 * (most // side))  # (a pooled frame gives fewer rows)
    return {**shapes, "feature_index": trt_profile.per_patch(rows, 4), "feature_weight": trt_profile.per_patch(rows, 4)}


class LlavaOnevisionVisionTower(LlavaVisionTower):
    """Input `pixel_values` [views * S^2, patch_dim], `feature_index` / `feature_weight` [R, 4];
    output float32 [R, out_hidden]."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg)
        self.image_newline = torch.nn.Parameter(torch.zeros(cfg["out_hidden_size"]))

    def forward(self, pixel_values: torch.Tensor, feature_index: torch.Tensor,
                feature_weight: torch.Tensor) -> torch.Tensor:
        table = torch.cat([super().forward(pixel_values), self.image_newline.float()[None]], dim=0)
        return (table[feature_index] * feature_weight[..., None]).sum(dim=1)


class LlavaOnevisionTower(LlavaTower):
    module = LlavaOnevisionVisionTower
    METADATA_INPUTS = ("feature_index", "feature_weight")
    METADATA_AXES = {"feature_index": {0: "tokens"}, "feature_weight": {0: "tokens"}}
    PREFIXES = PREFIXES
    PACKED_FRAMES = True
    EXTRAS = ("image_sizes",)
    ROWS = staticmethod(embedding_rows)
    vision_settings = staticmethod(vision_settings)
    profile_shapes = staticmethod(profile_shapes)

    @classmethod
    def encoder_metadata(cls, grid_thw: np.ndarray, settings: dict[str, Any]) -> dict[str, np.ndarray]:
        """The plan of rows without image sizes: every row a video's frames."""
        return feature_plan(grid_thw, settings)

    @classmethod
    def metadata(cls, grid_thw: np.ndarray, settings: dict[str, Any],
                 extras: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        return feature_plan(grid_thw, settings, (extras or {}).get("image_sizes"))
