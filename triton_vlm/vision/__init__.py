"""Vision towers, one module per family, and the generic ONNX Runtime encoder.

A tower is a `triton_vlm.vision.tower.Tower` class (its torch module, metadata inputs, settings
and TensorRT shapes); the `Family` names it. Every tower encodes each temporal grid step on its own
(attention, rotary positions and position embeddings never cross frames), so the serving front
sends a video's frames as items of their own and the encoder runs steps of one spatial size
together; neither changes the result. Settings hold at least `patch_dim`, `out_hidden_size` and
`spatial_merge_size` (patches per embedding row along each side). What towers share (group
metadata, rotary tables, layers, weight loading) is in `common`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from triton_vlm.vision.tower import Tower


def get_tower(family: str) -> type["Tower"]:
    """The tower class of the family named `family`."""
    from triton_vlm.families import get_family

    return get_family(family).tower_class()
