"""Vision towers, one module per family, and the generic ONNX Runtime encoder.

A tower module provides: `INPUT_NAMES` / `METADATA_INPUTS` / `OUTPUT_NAME`,
`vision_settings(config) -> dict`, `encoder_metadata(grid_thw, settings) -> dict[str, np.ndarray]`,
`load_tower(checkpoint_dir, dtype)`, `checkpoint_settings(config_json)` /
`read_vision_config(checkpoint_dir)` (the settings of a checkpoint's `config.json`),
`example_inputs(settings)`, `dynamic_axes()`, `profile_shapes(settings, (min, opt, max) patches)`
(TensorRT shapes of every input). Every tower encodes each temporal grid step on its own
(attention, rotary positions and position embeddings never cross frames), so the serving front
sends a video's frames as items of their own and the encoder runs steps of one spatial size
together; neither changes the result. Settings hold at least `patch_dim`, `out_hidden_size` and
`spatial_merge_size` (patches per embedding row along each side). What towers share (group
metadata, rotary tables, layers, weight loading) is in `common`.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# family name -> module path; the three GLM variants share one tower.
_TOWERS = {"qwen2_5_vl": "triton_vlm.vision.qwen2_5_vl", "glm4v": "triton_vlm.vision.glm4v",
           "glm46v": "triton_vlm.vision.glm4v", "glmga": "triton_vlm.vision.glm4v",
           "minicpmv4_6": "triton_vlm.vision.minicpmv"}


def get_tower(family: str) -> ModuleType:
    try:
        return importlib.import_module(_TOWERS[family])
    except KeyError:
        raise ValueError(f"no vision tower for family {family!r}; supported: {', '.join(_TOWERS)}") from None


def supported_families() -> tuple[str, ...]:
    return tuple(_TOWERS)
