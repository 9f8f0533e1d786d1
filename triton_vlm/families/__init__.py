"""Model families: each module holds one family's rules as data plus small functions.

`detect_family` reads a checkpoint's own config (never a user-supplied name) and returns the
family that serves it.
"""
from __future__ import annotations

import json
from pathlib import Path

from triton_vlm.families.base import Family
from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL

FAMILIES: dict[str, Family] = {f.name: f for f in (QWEN2_5_VL,)}


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown family {name!r}; supported: {', '.join(FAMILIES)}") from None


def detect_family(checkpoint: str | Path) -> Family:
    """The family whose `model_types` holds the checkpoint config's `model_type`."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    model_type = config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    raise ValueError(f"{checkpoint}: model_type {model_type!r} is not supported; supported: "
                     + ", ".join(t for f in FAMILIES.values() for t in f.model_types))
