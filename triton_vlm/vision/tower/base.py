"""`Tower`: one family's vision tower as the encoders, the ONNX exporter and the TensorRT builder
see it. A subclass names its torch module (`module`, parameter names as in the HF state_dict),
its metadata inputs and their dynamic axes, and implements `vision_settings`, `encoder_metadata`
and `profile_shapes` (and `weight_settings` where no config key sizes the tower); reading a
checkpoint, loading its weights, example inputs and the full ONNX axes are the same for every
tower and live here. Towers hold no state: everything is a class method, and a `Family` names its
tower class (`Family.tower_class`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import numpy as np
import torch
import torch.nn as nn

from triton_vlm.vision.tower import attention_groups
from triton_vlm.vision.tower import config as tower_config
from triton_vlm.vision.tower import rows, trt_profile


class Tower:
    module: ClassVar[type[nn.Module]]
    METADATA_INPUTS: ClassVar[tuple[str, ...]]
    INPUT_NAMES: ClassVar[tuple[str, ...]]
    OUTPUT_NAME: ClassVar[str] = "embeddings"
    # ONNX dynamic axes of the metadata inputs (`pixel_values` and the output are added).
    METADATA_AXES: ClassVar[dict[str, dict[int, str]]]
    # checkpoint name prefix -> the module's name prefix
    PREFIXES: ClassVar[Mapping[str, str]] = tower_config.PREFIXES
    # Settings read from the whole `config.json` rather than its `vision_config` (some keep
    # tower fields, such as the merger's or `query_num`, at the top level).
    WHOLE_CONFIG: ClassVar[bool] = False
    # the grid_thw of `example_inputs` (tracing, smoke tests)
    EXAMPLE_GRID: ClassVar[tuple[tuple[int, int, int], ...]] = ((1, 4, 6), (2, 8, 8))
    # A grid row's frames are one group that the tower takes whole; otherwise every frame of a row
    # is independent (`triton_vlm.vision`), the unit the encoders batch and cache.
    PACKED_FRAMES: ClassVar[bool] = False
    # The per-item extras (`triton_vlm.contract.tensors.EXTRAS`) it takes beside the pixels, by name;
    # the encoders refuse the others.
    EXTRAS: ClassVar[tuple[str, ...]] = ()
    # Embedding rows of each grid row, numpy only, so that the torch-free encoder front counts them
    # with the very function: `ROWS(grid_thw, settings, extras) -> int64 [M]`.
    ROWS: ClassVar[Callable[..., np.ndarray]] = staticmethod(rows.embedding_rows)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.INPUT_NAMES = ("pixel_values",) + cls.METADATA_INPUTS

    @classmethod
    def vision_settings(cls, vision_config: Any) -> dict[str, Any]:
        """A vision config (HF config object or dict) as a plain JSON-able dict of the fields the
        tower uses, with at least `patch_dim`, `out_hidden_size` and `spatial_merge_size`."""
        raise NotImplementedError

    @classmethod
    def encoder_metadata(cls, grid_thw: np.ndarray, settings: dict[str, Any]) -> dict[str, np.ndarray]:
        """The metadata inputs (`METADATA_INPUTS`) for `grid_thw` [M, 3], computed with numpy."""
        raise NotImplementedError

    @classmethod
    def metadata(cls, grid_thw: np.ndarray, settings: dict[str, Any],
                 extras: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """`encoder_metadata` of one run; `extras`: the values of the `EXTRAS` it takes for this
        run's grid rows (those of a tower that takes none are refused before)."""
        return cls.encoder_metadata(grid_thw, settings)

    @classmethod
    def embedding_rows(cls, grid_thw: np.ndarray, settings: dict[str, Any],
                       extras: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """Embedding rows of each grid row (`ROWS`)."""
        return cls.ROWS(grid_thw, settings, extras or {})

    @classmethod
    def embedding_width(cls, settings: dict[str, Any]) -> int:
        """The width of an output row (`triton_vlm.contract.tensors.embedding_width`): the merger's
        `out_hidden_size`, and a tower that gives DeepStack maps more."""
        return int(settings["out_hidden_size"])

    @classmethod
    def warmup_grid(cls, settings: dict[str, Any], min_patches: int = 1) -> np.ndarray:
        """grid_thw [1, 3] of the smallest item of at least `min_patches` patches the tower takes (a
        runtime's first run): a square of whole merge blocks."""
        merge = side = settings["spatial_merge_size"]
        while side * side < min_patches:
            side += merge
        return np.array([[1, side, side]], dtype=np.int64)

    @classmethod
    def profile_shapes(cls, settings: dict[str, Any], patches: tuple[int, int, int]) -> trt_profile.Shapes:
        """TensorRT (min, opt, max) shape of every input for runs of `patches` (min, opt, max) rows."""
        raise NotImplementedError

    @classmethod
    def checkpoint_settings(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The settings of a checkpoint's `config.json`."""
        return cls.vision_settings(config if cls.WHOLE_CONFIG else config["vision_config"])

    @classmethod
    def weight_settings(cls, settings: dict[str, Any], checkpoint_dir: str | Path) -> dict[str, Any]:
        """`settings` completed with the sizes that only the checkpoint's weights give (a tower that
        no config key sizes); the others' settings are complete already."""
        return settings

    @classmethod
    def read_vision_config(cls, checkpoint_dir: str | Path) -> dict[str, Any]:
        """The settings of a checkpoint: its `config.json`'s, completed from its weights."""
        config = tower_config.read_config_json(checkpoint_dir, cls.WHOLE_CONFIG)
        return cls.weight_settings(cls.checkpoint_settings(config), checkpoint_dir)

    @classmethod
    def load_tower(cls, checkpoint_dir: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The torch tower with the checkpoint's weights (every one of them, strictly), in `dtype`."""
        return tower_config.load_strict(cls.module(cls.read_vision_config(checkpoint_dir)), checkpoint_dir, dtype,
                                  cls.PREFIXES)

    @classmethod
    def example_inputs(cls, settings: dict[str, Any], grid_thw=None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Random float32 pixel rows for `grid_thw` (default `EXAMPLE_GRID`) and their metadata."""
        return attention_groups.example_inputs(settings, cls.encoder_metadata, grid_thw or cls.EXAMPLE_GRID)

    @classmethod
    def dynamic_axes(cls) -> dict[str, dict[int, str]]:
        return {"pixel_values": {0: "patches"}, **cls.METADATA_AXES, cls.OUTPUT_NAME: {0: "tokens"}}
