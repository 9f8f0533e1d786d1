"""The `torch` encoder back end: the family's torch tower (`Tower.module`, the checkpoint's
weights) run eagerly, on CUDA in bfloat16 / float16 (float32 too, and on the CPU for tests).

Same host metadata and run plan as the compiled back ends (`TowerEncoder`); attention is
`tower_layers.sdpa_groups` (fused SDPA per attention group, no score tensor). Inputs and outputs stay
float32 on the host; the residual stream (`tower_layers.residual_stream`), norms, rotary and softmax
statistics run in float32 inside the tower.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from triton_vlm.families import detect_family
from triton_vlm.llm.device import parse_dtype
from triton_vlm.vision import get_tower
from triton_vlm.vision.encoder import TowerEncoder

class TorchEncoder(TowerEncoder):
    """`checkpoint_dir`'s tower on `device` (cpu, cuda, cuda:N) in `dtype` (float32, bfloat16, float16)."""

    def __init__(self, checkpoint_dir: str | Path, device: str = "cpu", dtype: str = "float32",
                 max_patches_per_run: int = 16384) -> None:
        torch_dtype = parse_dtype(dtype, "encoder dtype")
        family = detect_family(checkpoint_dir).name
        tower = get_tower(family)
        self._init_tower(family, tower.read_vision_config(checkpoint_dir), max_patches_per_run)
        self.dtype = dtype
        self.device = torch.device(device)
        self.module = tower.load_tower(checkpoint_dir, torch_dtype).to(self.device)

    def _run(self, pixels: np.ndarray, grid: np.ndarray, temporal_ids: np.ndarray | None,
             image_sizes: np.ndarray | None = None) -> np.ndarray:
        metadata = self.tower.metadata(grid, self.settings, temporal_ids, image_sizes)
        feeds = [torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32))]
        feeds += [torch.from_numpy(metadata[name]) for name in self.tower.METADATA_INPUTS]
        with torch.inference_mode():
            out = self.module(*(t.to(self.device, non_blocking=True) for t in feeds))
            return out.float().cpu().numpy()
