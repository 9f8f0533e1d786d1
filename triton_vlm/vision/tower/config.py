"""What a vision tower reads from a checkpoint: its vision config as a plain dict of the fields it
uses (with the derived sizes every tower states), and its weights, strictly."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn as nn

from triton_vlm.weights import read_safetensors


def as_dict(vision_config: Any) -> dict[str, Any]:
    """A vision config (HF config object or dict, e.g. `config.json`'s `vision_config`) as a dict."""
    if not isinstance(vision_config, Mapping):
        vision_config = vision_config.to_dict() if hasattr(vision_config, "to_dict") else vars(vision_config)
    return dict(vision_config)


def config_fields(vision_config: Any, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of `defaults` read from a vision config, plus `rope_theta` wherever the config
    keeps it (as transformers: `rope_scaling` over `rope_parameters`, then beside them)."""
    cfg = as_dict(vision_config)
    out = {key: cfg.get(key, default) for key, default in defaults.items()}
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    out["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", defaults.get("rope_theta", 10000.0))))
    return out


def square(value: Any, key: str) -> int:
    """An int from a size that may be given per axis (`[14, 14]`); non-square sizes are refused."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"non-square {key} {value} is not supported")
        value = value[0]
    return int(value)


def add_derived(out: dict[str, Any]) -> dict[str, Any]:
    out["head_dim"] = out["hidden_size"] // out["num_heads"]
    out["patch_dim"] = out["in_channels"] * out["temporal_patch_size"] * out["patch_size"] ** 2
    return out


def read_config_json(checkpoint_dir: str | Path, whole: bool = False) -> dict[str, Any]:
    """The checkpoint's `config.json` (which must have a `vision_config`, unless the tower reads
    the `whole` config)."""
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text(encoding="utf-8"))
    if not whole and "vision_config" not in config:
        raise ValueError(f"{checkpoint_dir}: config.json has no vision_config")
    return config


# checkpoint name prefix -> the tower module's name prefix
PREFIXES: dict[str, str] = {"model.visual.": "", "visual.": ""}


def load_state_dict(checkpoint_dir: str | Path, prefixes: Mapping[str, str] = PREFIXES) -> dict[str, torch.Tensor]:
    """The tower's weights from the safetensors, reading only those tensors: keys under a prefix
    of `prefixes` (default `model.visual.*` or `visual.*`), renamed to the tower's prefix."""
    def rename(key: str) -> str | None:
        return next((ours + key[len(p):] for p, ours in prefixes.items() if key.startswith(p)), None)

    state = read_safetensors(checkpoint_dir, rename)
    if not state:
        raise ValueError(f"{checkpoint_dir}: no vision tower weights (prefixes {tuple(prefixes)})")
    return state


def load_strict(tower: nn.Module, checkpoint_dir: str | Path, dtype: torch.dtype,
                prefixes: Mapping[str, str] = PREFIXES) -> nn.Module:
    tower.load_state_dict(load_state_dict(checkpoint_dir, prefixes), strict=True)
    return tower.to(dtype).eval()
