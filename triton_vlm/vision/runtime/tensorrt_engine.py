"""`--device gpu`: the exported ONNX tower compiled into a TensorRT engine, and an encoder that runs it.

NOT YET RUN ON A GPU: this module is complete code written against the TensorRT 10 Python API
(`tensorrt`), but no machine with a GPU and `tensorrt` has built or run an engine with it yet.
It is importable without `tensorrt` or CUDA (every import is inside a function).

Build: an ONNX export of the tower in the engine's precision (`GRAPH_DTYPES`: float32, float16 or
bfloat16 weights and matrix products; the residual stream, norms and rotary in float32 in every
export, attention in the graph's precision),
parsed into a *strongly typed* network, so TensorRT runs each tensor in the type the graph gives
it. A float32 graph under the FP16 builder flag (weak typing) would let TensorRT pick float16 for
an RMSNorm's x^2 and mean, which overflow once |x| > 256 (real vision towers have such
activations); weak typing is also gone in TensorRT 11. One optimisation profile. Every dynamic
input dimension derives from the number of patch rows of one engine run, so the profile is given
as min/opt/max patches and the tower class turns it into shapes (`Tower.profile_shapes`):

- `pixel_values`, `rotary_cos/sin`, `*_inverse`, `pos_grid`: [patches, ...];
- a window-attention tower's `window_index/mask`: [windows, window_len], windows <= patches / merge^2 (a window
  holds at least one merge unit), window_len <= the window's area in patches;
- `full_index/mask`: [frames, frame_len], frames <= patches / merge^2, frame_len <= patches.
- a window-merger tower's `patch_order`, `position_ids`: [patches]; `merged_index/mask`: [slices, len] after
  the 2x2 window merger (patches / 4 rows), `merged_inverse`: [patches / 4].

Frames over the profile's max never reach the engine: the build writes `trt_max_patches` into
`preprocess`'s `max_frame_patches` limit, so such an item is INVALID_ARG there (and `TensorRTEncoder`
refuses it as INVALID_ARG too, before `set_input_shape`, whose result is checked).

Attention memory: a float16 / bfloat16 export writes each group's attention in TensorRT's
attention-fusion form (`tower_layers.group_attention`): q scaled before MatMul(q, k^T), the additive key
mask, Softmax, MatMul(p, v), all in the graph's precision with no Cast inside the chain, which is
the pattern TensorRT 10 fuses into its flash-attention kernel (no [heads, L, L] tensor: a 16k-patch
frame needs its q, k, v and output, 16384 x 1280 x 2 bytes = 40 MiB each at the 7B's width); the
tests check every attention of those graphs has that form. Whether TensorRT does fuse it is NOT YET
KNOWN, since no engine has been built; unfused, the scores of a 16k-patch full-attention frame at 16
heads would take 16 x 16384^2 x 2 bytes = 8 GiB (and the float32 graph's 16 GiB), which is why
`trt_max_patches` defaults to 16384 and is the bound to lower on smaller GPUs. The `torch` back end
(`torch_encoder`) avoids the tensor by construction: fused SDPA per attention group
(`tower_layers.sdpa_groups`).

Run: `TensorRTEncoder` has the interface of the ONNX Runtime `VisionEncoder` (`encode`,
`warmup`, `embedding_rows`, ...): host metadata from the tower class, runs of at most `max` patches
(frames of one size together, each video frame on its own), buffers as torch CUDA
tensors, `execute_async_v3` on a torch stream.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from triton_vlm.errors import InvalidInput
from triton_vlm.families import get_family
from triton_vlm.vision.runtime.encoder import TowerEncoder

# engine precision -> the `export_onnx` dtype of the graph it is built from
GRAPH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
PRECISIONS = tuple(GRAPH_DTYPES)


@dataclass(frozen=True)
class EngineProfile:
    min_patches: int = 4
    opt_patches: int = 4096
    max_patches: int = 16384

    def __post_init__(self) -> None:
        if not 0 < self.min_patches <= self.opt_patches <= self.max_patches:
            raise ValueError(f"TensorRT profile needs 0 < min <= opt <= max patches, got "
                             f"{self.min_patches}/{self.opt_patches}/{self.max_patches}")


def profile_shapes(family: str, settings: dict, profile: EngineProfile) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) shape of every engine input: the family's tower class knows its inputs."""
    return get_family(family).tower_class().profile_shapes(
        settings, (profile.min_patches, profile.opt_patches, profile.max_patches))


def build_engine(onnx_path: str | Path, engine_path: str | Path, profile: EngineProfile = EngineProfile(),
                 precision: str = "fp16", workspace_bytes: int = 4 << 30) -> Path:
    """Compile `onnx_path` (written by `export_onnx` with dtype `GRAPH_DTYPES[precision]`) into a
    serialized TensorRT engine."""
    import onnx

    from triton_vlm.vision.runtime.export import unfuse_attention

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    proto = onnx.load(str(onnx_path), load_external_data=False)
    meta = {p.key: p.value for p in proto.metadata_props}
    if meta.get("dtype", "float32") != GRAPH_DTYPES[precision]:
        raise ValueError(f"{onnx_path} is a {meta.get('dtype', 'float32')} export; a {precision} engine is built "
                         f"from a {GRAPH_DTYPES[precision]} one (export_onnx dtype={GRAPH_DTYPES[precision]!r})")
    settings = json.loads(meta["vision_config"])

    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    # Float32 exports use ONNX Runtime's fused attention node; TensorRT parses the standard-op
    # form of the same graph (written next to the original so external weights still resolve).
    parse_path = Path(onnx_path)
    if unfuse_attention(proto):
        parse_path = parse_path.with_name(parse_path.stem + ".unfused.onnx")
        onnx.save(proto, str(parse_path))
    try:
        if not parser.parse_from_file(str(parse_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    finally:
        if parse_path != Path(onnx_path):
            parse_path.unlink(missing_ok=True)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if precision == "fp32":  # TF32 (on by default) would round the float32 matrix products' inputs
        config.clear_flag(trt.BuilderFlag.TF32)
    opt_profile = builder.create_optimization_profile()
    shapes = profile_shapes(meta["family"], settings, profile)
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        lo, mid, hi = shapes[name]
        opt_profile.set_shape(name, lo, mid, hi)
    config.add_optimization_profile(opt_profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path}")
    engine_path = Path(engine_path)
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    engine_path.write_bytes(bytes(serialized))
    # What the runtime needs beside the engine (TensorRT engines carry no free-form metadata).
    sidecar = {"family": meta["family"], "vision_config": settings, "precision": precision,
               "min_patches": profile.min_patches, "opt_patches": profile.opt_patches,
               "max_patches": profile.max_patches}
    engine_path.with_suffix(".json").write_text(json.dumps(sidecar, indent=1))
    return engine_path


class TensorRTEncoder(TowerEncoder):
    """Runs an engine from `build_engine` on one GPU; validation, run planning and `encode` are
    `TowerEncoder`'s, as for the ONNX Runtime encoder."""

    def __init__(self, engine_path: str | Path, device: int = 0) -> None:
        import tensorrt as trt
        import torch

        engine_path = Path(engine_path)
        sidecar = json.loads(engine_path.with_suffix(".json").read_text(encoding="utf-8"))
        self._init_tower(sidecar["family"], sidecar["vision_config"], int(sidecar["max_patches"]))
        self.dtype = sidecar["precision"]
        self.min_patches = int(sidecar["min_patches"])
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{engine_path}: TensorRT could not deserialize the engine")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream(self.device)
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self._inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._output = next(n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT)

    def _run(self, pixels: np.ndarray, grid: np.ndarray, extras: Mapping[str, np.ndarray]) -> np.ndarray:
        import torch

        feeds = {"pixel_values": np.ascontiguousarray(pixels, dtype=np.float32)}
        feeds.update(self.tower.metadata(grid, self.settings, extras))
        n = feeds["pixel_values"].shape[0]
        if n < self.min_patches:  # the smallest item (one merge unit) is 4 patches: keep min_patches <= 4
            raise ValueError(f"{n} patches is below the engine profile's min_patches={self.min_patches}")
        if n > self.max_patches_per_run:  # a frame alone over the profile (preprocess refuses those first)
            raise InvalidInput(f"grid_thw: a frame of {n} patches exceeds the TensorRT profile's "
                               f"max_patches={self.max_patches_per_run}")
        buffers = {}
        with torch.cuda.stream(self.stream):
            for name in self._inputs:
                tensor = torch.from_numpy(np.ascontiguousarray(feeds[name])).to(self.device, non_blocking=True)
                buffers[name] = tensor
                if not self.context.set_input_shape(name, tuple(tensor.shape)):
                    raise RuntimeError(f"TensorRT refused {name} of shape {list(tensor.shape)} (outside the "
                                       "engine's optimisation profile)")
                self.context.set_tensor_address(name, tensor.data_ptr())
            shape = tuple(self.context.get_tensor_shape(self._output))
            out = torch.empty(shape, dtype=torch.float32, device=self.device)
            self.context.set_tensor_address(self._output, out.data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execution failed")
            result = out.cpu()
        self.stream.synchronize()
        return result.numpy()

    def warmup(self) -> None:
        grid = self.tower.warmup_grid(self.settings, self.min_patches)
        self.encode(np.zeros((int(grid.prod()), self.patch_dim), np.float32), grid)
