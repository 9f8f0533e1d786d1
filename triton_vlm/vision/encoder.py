"""Generic vision encoders: host metadata + one or more runs of a compiled tower.

`TowerEncoder` holds what every runtime shares (input checks, the plan of runs, `encode`);
`VisionEncoder` runs the ONNX export with ONNX Runtime, `tensorrt_engine.TensorRTEncoder` a
TensorRT engine, `torch_encoder.TorchEncoder` the torch tower itself. Family specifics (metadata, sizes) come from the tower class of the family
named in the export's metadata.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from triton_vlm.errors import InvalidInput
from triton_vlm.vision import get_tower


class TowerEncoder:
    """An exported tower behind one runtime. `max_patches_per_run` bounds one run: items and
    video frames of the same spatial size are run together up to that many patches, so groups
    are never padded to a much larger item and attention memory stays bounded. A runtime sets
    the tower up with `_init_tower` and supplies `_run(pixels, grid, temporal_ids)` (one run,
    its metadata from `Tower.metadata`)."""

    def _init_tower(self, family: str, settings: dict, max_patches_per_run: int) -> None:
        self.family = family
        self.tower = get_tower(family)
        self.settings = settings
        self.patch_dim = int(settings["patch_dim"])
        self.out_hidden = int(settings["out_hidden_size"])
        self.tower_merge = int(settings["spatial_merge_size"])
        self.max_patches_per_run = int(max_patches_per_run)

    def _run(self, pixels: np.ndarray, grid: np.ndarray, temporal_ids: np.ndarray | None,
             image_sizes: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def warmup(self) -> None:
        """One smallest item through the runtime: runtimes allocate on their first run."""
        grid = self.tower.warmup_grid(self.settings)
        self.encode(np.zeros((int(grid.prod()), self.patch_dim), np.float32), grid)

    def _validate(self, pixel_values, grid_thw, temporal_ids, image_sizes
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        pixels, grid = validate_inputs(pixel_values, grid_thw, self.patch_dim, self.tower_merge)
        return (pixels, grid, validate_temporal_ids(temporal_ids, grid, self.tower.PACKED_FRAMES),
                validate_image_sizes(image_sizes, grid, self.tower.IMAGE_SIZES))

    def embedding_rows(self, grid: np.ndarray, image_sizes: np.ndarray | None = None) -> np.ndarray:
        """Embedding rows of each grid row (`Tower.embedding_rows`)."""
        return self.tower.embedding_rows(grid, self.settings, image_sizes)

    def _plan(self, grid: np.ndarray, image_sizes: np.ndarray | None = None
              ) -> list[list[tuple[int, int, int, int, int, int]]]:
        """Runs of pieces (patch_offset, token_offset, frame_offset, t, h, w) that share a spatial
        size: each frame on its own (frames are independent, `triton_vlm.vision`), or a packed
        tower's grid rows whole."""
        pieces: dict[tuple[int, int], list[tuple[int, int, int, int, int, int]]] = {}
        patch_off = token_off = frame_off = 0
        for (t, h, w), rows in zip(grid.tolist(), self.embedding_rows(grid, image_sizes).tolist()):
            if self.tower.PACKED_FRAMES:
                pieces.setdefault((h, w), []).append((patch_off, token_off, frame_off, t, h, w))
            else:
                for f in range(t):
                    pieces.setdefault((h, w), []).append((patch_off + f * h * w, token_off + f * rows // t,
                                                          frame_off + f, 1, h, w))
            patch_off += t * h * w
            token_off += rows
            frame_off += t
        runs = []
        for group in pieces.values():
            run, size = [], 0
            for piece in group:
                n = piece[3] * piece[4] * piece[5]
                if run and size + n > self.max_patches_per_run:
                    runs.append(run)
                    run, size = [], 0
                run.append(piece)
                size += n
            runs.append(run)
        return runs

    def encode(self, pixel_values: np.ndarray, grid_thw: np.ndarray, temporal_ids: np.ndarray | None = None,
               image_sizes: np.ndarray | None = None) -> np.ndarray:
        """Embeddings float32 [tokens, out_hidden], one row per placeholder token, item order.
        `temporal_ids`: one per frame of each grid row (`validate_temporal_ids`), or None;
        `image_sizes`: one (height, width) per grid row (`validate_image_sizes`), or None."""
        pixels, grid, temporal_ids, image_sizes = self._validate(pixel_values, grid_thw, temporal_ids, image_sizes)
        total_tokens = int(self.embedding_rows(grid, image_sizes).sum())
        if total_tokens == 0:
            return np.zeros((0, self.out_hidden), dtype=np.float32)
        runs = self._plan(grid, image_sizes)
        if len(runs) == 1 and sum(p[3] * p[4] * p[5] for p in runs[0]) == pixels.shape[0]:
            return np.ascontiguousarray(self._run(pixels, grid, temporal_ids, image_sizes), dtype=np.float32)
        out = np.empty((total_tokens, self.out_hidden), dtype=np.float32)
        frame_starts = np.cumsum(grid[:, 0]) - grid[:, 0]
        for run in runs:
            run_grid = np.array([[n, h, w] for *_, n, h, w in run], dtype=np.int64)
            run_pixels = _rows(pixels, [(p, p + n * h * w) for p, _, _, n, h, w in run])
            run_ids = None if temporal_ids is None else np.concatenate([temporal_ids[f:f + n] for _, _, f, n, _, _ in run])
            # (image sizes go with towers that take grid rows whole: a piece's first frame is its row's)
            run_sizes = None if image_sizes is None else image_sizes[np.searchsorted(frame_starts, [f for _, _, f, *_ in run])]
            emb = self._run(run_pixels, run_grid, run_ids, run_sizes)
            row = 0
            for (_, tok, *_), k in zip(run, self.embedding_rows(run_grid, run_sizes).tolist()):
                out[tok:tok + k] = emb[row:row + k]
                row += k
        return out


class VisionEncoder(TowerEncoder):
    """Runs an ONNX vision tower written by `triton_vlm.vision.export.export_onnx` with ONNX Runtime.

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

    def _run(self, pixels: np.ndarray, grid: np.ndarray, temporal_ids: np.ndarray | None,
             image_sizes: np.ndarray | None = None) -> np.ndarray:
        feeds = {"pixel_values": np.ascontiguousarray(pixels, dtype=np.float32)}
        for name, value in self.tower.metadata(grid, self.settings, temporal_ids, image_sizes).items():
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


def validate_inputs(pixel_values, grid_thw, patch_dim: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Check the contract's `pixel_values` [N, patch_dim] / `grid_thw` [M, 3]; InvalidInput names the input."""
    grid = np.asarray(grid_thw)
    if grid.size == 0:
        grid = grid.reshape(0, 3)
    if grid.ndim != 2 or grid.shape[1] != 3:
        raise InvalidInput(f"grid_thw: expected shape [items, 3], got {list(grid.shape)}")
    if not np.issubdtype(grid.dtype, np.integer):
        raise InvalidInput(f"grid_thw: expected integers, got {grid.dtype}")
    grid = grid.astype(np.int64)
    for i, (t, h, w) in enumerate(grid.tolist()):
        if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
            raise InvalidInput(f"grid_thw[{i}]: [{t}, {h}, {w}] must be positive with h and w "
                               f"multiples of {merge}")
    pixels = np.asarray(pixel_values)
    if pixels.ndim != 2:
        raise InvalidInput(f"pixel_values: expected shape [patches, {patch_dim}], got {list(pixels.shape)}")
    expected = int(grid.prod(axis=1).sum())
    if pixels.shape[0] != expected:
        raise InvalidInput(f"pixel_values: {pixels.shape[0]} rows, but grid_thw describes {expected} patches")
    if expected and pixels.shape[1] != patch_dim:
        raise InvalidInput(f"pixel_values: rows are {pixels.shape[1]} wide, expected {patch_dim}")
    if expected and not np.issubdtype(pixels.dtype, np.floating):
        raise InvalidInput(f"pixel_values: expected floating point, got {pixels.dtype}")
    return pixels, grid


def validate_image_sizes(image_sizes, grid: np.ndarray, takes: bool) -> np.ndarray | None:
    """The optional `image_sizes` input: int64 [grid rows, 2], each row's image's (height, width),
    (0, 0) for none, which only a tower that unpads images takes (`Tower.IMAGE_SIZES`). None when
    absent or all zero; InvalidInput names the input."""
    if image_sizes is None:
        return None
    sizes = np.asarray(image_sizes)
    if sizes.shape != (len(grid), 2):
        raise InvalidInput(f"image_sizes: expected shape [{len(grid)}, 2] (one per row of grid_thw), "
                           f"got {list(sizes.shape)}")
    if not np.issubdtype(sizes.dtype, np.integer):
        raise InvalidInput(f"image_sizes: expected integers, got {sizes.dtype}")
    sizes = sizes.astype(np.int64)
    if (sizes < 0).any() or (sizes > np.iinfo(np.int32).max).any():
        raise InvalidInput(f"image_sizes: values must lie in [0, {np.iinfo(np.int32).max}]")
    if not sizes.any():
        return None
    if not takes:
        raise InvalidInput("image_sizes: this model's vision tower takes none")
    return sizes


def validate_temporal_ids(temporal_ids, grid: np.ndarray, packed: bool) -> np.ndarray | None:
    """The optional `temporal_ids` input: int64, one per frame of each grid row (sum of
    grid_thw[:, 0]), each -1 (none) or a frame's temporal id, which only a tower that packs frames
    takes (`Tower.PACKED_FRAMES`). None when absent or all -1; InvalidInput names the input."""
    if temporal_ids is None:
        return None
    ids = np.asarray(temporal_ids)
    frames = int(grid[:, 0].sum())
    if ids.ndim != 1 or len(ids) != frames:
        raise InvalidInput(f"temporal_ids: expected shape [{frames}] (one per frame of grid_thw), got {list(ids.shape)}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InvalidInput(f"temporal_ids: expected integers, got {ids.dtype}")
    ids = ids.astype(np.int64)
    if (ids < -1).any() or (ids > np.iinfo(np.int32).max).any():
        raise InvalidInput(f"temporal_ids: values must lie in [-1, {np.iinfo(np.int32).max}]")
    if not (ids >= 0).any():
        return None
    if not packed:
        raise InvalidInput("temporal_ids: this model's vision tower takes none (its frames are not packed)")
    return ids
