"""Generic vision encoders: host metadata + one or more runs of a compiled tower.

`TowerEncoder` holds what every runtime shares (input checks, the plan of runs, `encode`);
`VisionEncoder` runs the ONNX export with ONNX Runtime, `tensorrt_engine.TensorRTEncoder` a
TensorRT engine, `torch_encoder.TorchEncoder` the torch tower itself. Family specifics (metadata,
sizes) come from the tower class of the family named in the export's metadata.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import numpy as np

from triton_vlm.contract.messages import check_extras, check_media
from triton_vlm.contract.tensors import EXTRA


class TowerEncoder:
    """An exported tower behind one runtime. `max_patches_per_run` bounds one run: items and
    video frames of the same spatial size are run together up to that many patches, so groups
    are never padded to a much larger item and attention memory stays bounded. A runtime sets
    the tower up with `_init_tower` and supplies `_run(pixels, grid, extras)` (one run, its
    metadata from `Tower.metadata`)."""

    def _init_tower(self, family: str, settings: dict, max_patches_per_run: int) -> None:
        from triton_vlm.families import get_family

        self.family = family
        self.tower = get_family(family).tower_class()
        self.settings = settings
        self.patch_dim = int(settings["patch_dim"])
        self.out_hidden = self.tower.embedding_width(settings)
        self.tower_merge = int(settings["spatial_merge_size"])
        self.max_patches_per_run = int(max_patches_per_run)

    def _run(self, pixels: np.ndarray, grid: np.ndarray, extras: Mapping[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    def warmup(self) -> None:
        """One smallest item through the runtime: runtimes allocate on their first run."""
        grid = self.tower.warmup_grid(self.settings)
        self.encode(np.zeros((int(grid.prod()), self.patch_dim), np.float32), grid)

    def embedding_rows(self, grid: np.ndarray, extras: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """Embedding rows of each grid row (`Tower.embedding_rows`)."""
        return self.tower.embedding_rows(grid, self.settings, extras)

    def _plan(self, grid: np.ndarray, extras: Mapping[str, np.ndarray]
              ) -> list[list[tuple[int, int, int, int, int, int, int]]]:
        """Runs of pieces (patch_offset, token_offset, frame_offset, grid row, t, h, w) that share
        a spatial size: each frame on its own (frames are independent, `triton_vlm.vision`), or a
        packed tower's grid rows whole."""
        pieces: dict[tuple[int, int], list[tuple[int, int, int, int, int, int, int]]] = {}
        patch_off = token_off = frame_off = 0
        for row, ((t, h, w), rows) in enumerate(zip(grid.tolist(), self.embedding_rows(grid, extras).tolist())):
            if self.tower.PACKED_FRAMES:
                pieces.setdefault((h, w), []).append((patch_off, token_off, frame_off, row, t, h, w))
            else:
                for f in range(t):
                    pieces.setdefault((h, w), []).append((patch_off + f * h * w, token_off + f * rows // t,
                                                          frame_off + f, row, 1, h, w))
            patch_off += t * h * w
            token_off += rows
            frame_off += t
        runs = []
        for group in pieces.values():
            run, size = [], 0
            for piece in group:
                n = piece[4] * piece[5] * piece[6]
                if run and size + n > self.max_patches_per_run:
                    runs.append(run)
                    run, size = [], 0
                run.append(piece)
                size += n
            runs.append(run)
        return runs

    def encode(self, pixel_values: np.ndarray, grid_thw: np.ndarray,
               extras: Mapping[str, np.ndarray | None] | None = None) -> np.ndarray:
        """Embeddings float32 [tokens, out_hidden], one row per placeholder token, item order.
        `extras`: the contract's per-item extras by name (`check_extras`: those the tower does not
        take are refused)."""
        pixels, grid = check_media(pixel_values, grid_thw, self.patch_dim, self.tower_merge)
        extras = check_extras(extras, grid, self.tower.EXTRAS)
        total_tokens = int(self.embedding_rows(grid, extras).sum())
        if total_tokens == 0:
            return np.zeros((0, self.out_hidden), dtype=np.float32)
        runs = self._plan(grid, extras)
        if len(runs) == 1 and sum(p[4] * p[5] * p[6] for p in runs[0]) == pixels.shape[0]:
            return np.ascontiguousarray(self._run(pixels, grid, extras), dtype=np.float32)
        out = np.empty((total_tokens, self.out_hidden), dtype=np.float32)
        for run in runs:
            run_grid = np.array([[n, h, w] for *_, n, h, w in run], dtype=np.int64)
            run_pixels = _rows(pixels, [(p, p + n * h * w) for p, _, _, _, n, h, w in run])
            run_extras = {name: np.concatenate([EXTRA[name].item(value, row, f, n) for _, _, f, row, n, _, _ in run])
                          for name, value in extras.items()}
            emb = self._run(run_pixels, run_grid, run_extras)
            row = 0
            for (_, tok, *_), k in zip(run, self.embedding_rows(run_grid, run_extras).tolist()):
                out[tok:tok + k] = emb[row:row + k]
                row += k
        return out


class VisionEncoder(TowerEncoder):
    """Runs an ONNX vision tower written by `triton_vlm.vision.runtime.export.export_onnx` with ONNX Runtime.

    Graph optimisations are all on; `intra_op_threads` None or 0 takes every usable core (the
    Triton model passes the cores divided by the instance count). Runs are kept to
    `max_patches_per_run` patches (a larger frame runs alone): smaller working sets make a batch
    of 16 448x448 images 8 to 15% faster than one run of them on the CPU (bench/RESULTS.md).
    Results are the same either way (within float32 rounding).
    """

    def __init__(self, onnx_path: str | Path, intra_op_threads: int | None = None, max_patches_per_run: int = 2048,
                 providers: list | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = int(intra_op_threads or default_threads())  # 0 / None: all cores
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(onnx_path), options,
                                            providers=providers or ["CPUExecutionProvider"])
        meta = self.session.get_modelmeta().custom_metadata_map
        if "family" not in meta or "vision_config" not in meta:
            raise ValueError(f"{onnx_path}: not a triton-vlm vision encoder (no family metadata)")
        self._init_tower(meta["family"], json.loads(meta["vision_config"]), max_patches_per_run)
        self.dtype = meta.get("dtype", "float32")
        self._input_names = {i.name for i in self.session.get_inputs()}

    def _run(self, pixels: np.ndarray, grid: np.ndarray, extras: Mapping[str, np.ndarray]) -> np.ndarray:
        feeds = {"pixel_values": np.ascontiguousarray(pixels, dtype=np.float32)}
        for name, value in self.tower.metadata(grid, self.settings, extras).items():
            if name in self._input_names:  # the exporter drops inputs a graph does not use
                feeds[name] = value
        return self.session.run(None, feeds)[0]


def _rows(pixels: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """The rows of `spans` (start, end) in order: a view when they follow each other (consecutive
    items of one size, the usual batch), a copy only otherwise."""
    if all(prev[1] == nxt[0] for prev, nxt in zip(spans, spans[1:])):
        return pixels[spans[0][0]:spans[-1][1]]
    return np.concatenate([pixels[a:b] for a, b in spans], axis=0)


def default_threads(instances: int = 1) -> int:
    """Intra-op threads for one of `instances` encoder instances: the usable cores split evenly."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(instances)))
