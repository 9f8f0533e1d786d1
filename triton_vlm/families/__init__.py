"""The family registry: one line per family folder (`triton_vlm.families.<name>`: its processor
rules, vision tower, decoder spec and demo checkpoint; `base.Family` is what the shared mechanisms
see of one). `detect_family` reads a checkpoint's own config (never a user-supplied name) and
returns the family that serves it.
"""
from __future__ import annotations

import json
from pathlib import Path

from triton_vlm.families import gemma3, glm4v, internvl, llava, minicpmv, qwen2_5_vl, qwen3_vl
from triton_vlm.families.base import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (
    *qwen2_5_vl.FAMILIES,
    *glm4v.FAMILIES,
    *minicpmv.FAMILIES,
    *llava.FAMILIES,
    *internvl.FAMILIES,
    *qwen3_vl.FAMILIES,
    *gemma3.FAMILIES,
)}
# The family of `make demo` and of the tools' defaults.
DEFAULT_FAMILY = qwen2_5_vl.QWEN2_5_VL.name


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown family {name!r}; supported: {', '.join(FAMILIES)}") from None


def _video_processor_type(checkpoint: Path) -> str | None:
    """The checkpoint's video processor class, from the v5 nested or the older separate file."""
    for name, key in (("processor_config.json", "video_processor"), ("video_preprocessor_config.json", None)):
        path = checkpoint / name
        if path.is_file():
            section = json.loads(path.read_text(encoding="utf-8"))
            section = section.get(key) or {} if key else section
            if section.get("video_processor_type"):
                return section["video_processor_type"]
    return None


def detect_family(checkpoint: str | Path) -> Family:
    """The family serving a checkpoint: among those listing the config's `model_type` (and its
    `version`, where a family names versions), the one whose video processor class matches the
    checkpoint's, else the one whose own model type it is."""
    checkpoint = Path(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    candidates = [f for f in FAMILIES.values() if model_type in f.model_types]
    if not candidates:
        raise ValueError(f"{checkpoint}: model_type {model_type!r} is not supported; supported: "
                         + ", ".join(dict.fromkeys(t for f in FAMILIES.values() for t in f.model_types)))
    served = [f for f in candidates if not f.versions or f.config_version(config) in f.versions]
    if not served:
        versioned = [f for f in candidates if f.versions]
        raise ValueError(f"{checkpoint}: {model_type} version {versioned[0].config_version(config)} is not supported; "
                         "supported versions: " + ", ".join(sorted(v for f in versioned for v in f.versions)))
    candidates = served
    video_processor = _video_processor_type(checkpoint)
    return max(candidates, key=lambda f: (video_processor in f.video_processor_types, f.model_types[0] == model_type))
