"""TensorRT (min, opt, max) optimisation-profile shapes of the inputs the towers share."""
from __future__ import annotations

from typing import Any

Shapes = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def frame_profile(settings: dict[str, Any], patches: tuple[int, int, int]) -> Shapes:
    """(min, opt, max) shapes of `pixel_values`, the rotary tables and the `full_*` inputs for
    engine runs of `patches` = (min, opt, max) patch rows."""
    rotary = per_patch(patches, settings["head_dim"])
    return {"pixel_values": per_patch(patches, settings["patch_dim"]), "rotary_cos": rotary, "rotary_sin": rotary,
            **group_profile("full", patches, settings["spatial_merge_size"] ** 2)}


def group_profile(prefix: str, rows: tuple[int, int, int], min_group: int) -> Shapes:
    """(min, opt, max) shapes of the `<prefix>_index / _mask / _inverse` inputs of one group per
    frame, for runs of `rows` = (min, opt, max) rows of which a frame holds at least `min_group`:
    frames <= rows / min_group, frame length <= rows; opt is one frame of opt rows."""
    _, opt, hi = rows
    frames = ((1, 1), (1, opt), (max(1, hi // min_group), hi))
    return {f"{prefix}_index": frames, f"{prefix}_mask": frames, f"{prefix}_inverse": per_patch(rows)}


def per_patch(patches: tuple[int, int, int], *width: int) -> tuple[tuple[int, ...], ...]:
    """(min, opt, max) shapes of an input with one row per patch."""
    return tuple((p, *width) for p in patches)
