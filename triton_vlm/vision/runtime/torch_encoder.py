"""The `torch` encoder back end: the family's torch tower (`Tower.module`, the checkpoint's
weights) run eagerly, on CUDA in bfloat16 / float16 (float32 too, and on the CPU for tests).

Same host metadata and run plan as the compiled back ends (`TowerEncoder`); attention is
`tower_layers.sdpa_groups` (fused SDPA per attention group, no score tensor). Inputs and outputs stay
float32 on the host; the residual stream (`tower_layers.residual_stream`), norms, rotary and softmax
statistics run in float32 inside the tower.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from triton_vlm.devices import parse_dtype
from triton_vlm.families import detect_family
from triton_vlm.vision.runtime.encoder import TowerEncoder


class TorchEncoder(TowerEncoder):
    """`checkpoint_dir`'s tower on `device` (cpu, cuda, cuda:N) in `dtype` (float32, bfloat16, float16)."""

    def __init__(self, checkpoint_dir: str | Path, device: str = "cpu", dtype: str = "float32",
                 max_patches_per_run: int = 16384) -> None:
        torch_dtype = parse_dtype(dtype, "encoder dtype")
        detected = detect_family(checkpoint_dir)
        family, tower = detected.name, detected.tower_class()
        self._init_tower(family, tower.read_vision_config(checkpoint_dir), max_patches_per_run)
        self.dtype = dtype
        self.device = torch.device(device)
        self.module = tower.load_tower(checkpoint_dir, torch_dtype).to(self.device)

    def _run(self, pixels: np.ndarray, grid: np.ndarray, extras: Mapping[str, np.ndarray]) -> np.ndarray:
        metadata = self.tower.metadata(grid, self.settings, extras)
        feeds = [torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32))]
        feeds += [torch.from_numpy(metadata[name]) for name in self.tower.METADATA_INPUTS]
        with torch.inference_mode():
            out = self.module(*(t.to(self.device, non_blocking=True) for t in feeds))
            return out.float().cpu().numpy()
