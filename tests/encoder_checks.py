"""Checks shared by the vision-tower test files."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from triton_vlm.vision.tower.base import Tower

ENCODER_MODELS = ("vision_encoder", "vision_encoder_batch")  # the encoder's two Triton models


def rel_err(out, ref) -> float:
    """max |out - ref| / max |ref| (float64), after checking the shapes agree."""
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def check_batched_whole_views(checkpoint: Path, onnx_path: Path, pixels: np.ndarray, grid: np.ndarray,
                              ref: np.ndarray) -> None:
    """Two requests in one batched execution (the server's `BatchedEncoder`, cache on: the repeated
    view is encoded once) give each request its own rows, through ONNX Runtime and torch; every grid
    row one view of the same size (LLaVA's, Gemma 3's towers)."""
    from triton_vlm.vision.batching import BatchedEncoder, EmbeddingCache
    from triton_vlm.vision.runtime.encoder import VisionEncoder
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    per_view, rows = pixels.shape[0] // len(grid), ref.shape[0] // len(grid)
    batch = [(pixels[:2 * per_view], grid[:2], {}), (pixels[per_view:], grid[1:], {})]
    for back_end in (VisionEncoder(onnx_path), TorchEncoder(checkpoint, "cpu", "float32")):
        (first, second), _ = BatchedEncoder(back_end, EmbeddingCache(1 << 24)).encode_many(batch)
        assert rel_err(first, ref[:2 * rows]) <= 1e-4 and rel_err(second, ref[rows:]) <= 1e-4


def encoder_models(repo: Path, out: Path) -> Path:
    """A repository at `out` holding only the encoder models of the build `repo`."""
    for name in ENCODER_MODELS:
        shutil.copytree(repo / name, out / name)
    return out


def encode(server, pixels: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """`vision_encoder`'s embeddings from a running server, over gRPC."""
    import tritonclient.grpc as grpcclient

    inputs = [grpcclient.InferInput("pixel_values", list(pixels.shape), "FP32"),
              grpcclient.InferInput("grid_thw", list(grid.shape), "INT64")]
    inputs[0].set_data_from_numpy(pixels)
    inputs[1].set_data_from_numpy(grid)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        return client.infer("vision_encoder", inputs).as_numpy("embeddings")


def unfused_copy(onnx_path: Path, out_path: Path) -> Path:
    """The form TensorRT parses: the export with attention unfused, checked to hold standard ONNX
    ops only (no `com.microsoft` node, no `If`), saved at `out_path`."""
    import onnx

    from triton_vlm.vision.runtime.export import unfuse_attention

    proto = onnx.load(str(onnx_path))
    assert unfuse_attention(proto)
    onnx.checker.check_model(proto)
    assert {n.domain for n in proto.graph.node} == {""} and [o.domain for o in proto.opset_import] == [""]
    assert not any(n.op_type == "If" for n in proto.graph.node)
    onnx.save(proto, str(out_path))
    return out_path


def check_unfused_matches(onnx_path: Path, tower: type["Tower"], settings: dict, cases: dict, tmp_path: Path) -> None:
    """The unfused copy of `onnx_path`, run by ONNX Runtime on the tower's own metadata, matches
    the reference of every case: name -> (pixels, grid_thw, reference)."""
    import onnxruntime as ort

    path = unfused_copy(onnx_path, tmp_path / "unfused.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}  # the exporter drops inputs a graph does not use
    for case, (pixels, grid, ref) in cases.items():
        inputs = {"pixel_values": pixels, **tower.encoder_metadata(grid, settings)}
        feeds = {k: v for k, v in inputs.items() if k in names}
        assert rel_err(session.run(None, feeds)[0], ref) < 1e-4, case


def check_engine_graphs(checkpoint: Path, float32_onnx: Path, tmp_path: Path) -> None:
    """The graphs TensorRT engines are built from (no TensorRT here, so the engines are not).

    - The bfloat16 export (bf16 engines; ONNX Runtime's CPU provider cannot run it) is the float16
      export, whose accuracy the tests check, with float16 read as bfloat16: the same nodes in the
      same order, the same initializers, every float16 type (casts, weights) now bfloat16, so the
      residual stream, norms and rotary still run in float32; and it passes ONNX's full type check.
    - Every attention of both is TensorRT's fusable chain in their half type (`check_attention_fusable`).
    - `build_engine` takes only the export of its precision's dtype (GRAPH_DTYPES) and says so
      before it needs TensorRT."""
    import onnx
    import pytest
    from onnx import TensorProto

    from triton_vlm.vision.runtime.export import export_onnx
    from triton_vlm.vision.runtime.tensorrt_engine import build_engine

    paths = {dt: export_onnx(checkpoint, tmp_path / f"{dt}.onnx", dtype=dt) for dt in ("float16", "bfloat16")}
    half, bf16 = (onnx.load(str(paths[dt])) for dt in ("float16", "bfloat16"))
    onnx.checker.check_model(bf16, full_check=True)

    def as_bf16(type_id: int) -> int:
        return TensorProto.BFLOAT16 if type_id == TensorProto.FLOAT16 else type_id

    assert [n.op_type for n in bf16.graph.node] == [n.op_type for n in half.graph.node]
    casts = [(a.name, a.i) for n in half.graph.node if n.op_type == "Cast" for a in n.attribute]
    assert any(to == TensorProto.FLOAT for _, to in casts) and any(to == TensorProto.FLOAT16 for _, to in casts)
    assert [(a.name, a.i) for n in bf16.graph.node if n.op_type == "Cast" for a in n.attribute] == [
        (name, as_bf16(to)) for name, to in casts]
    assert [(i.name, list(i.dims), as_bf16(i.data_type)) for i in half.graph.initializer] == [
        (i.name, list(i.dims), i.data_type) for i in bf16.graph.initializer]
    assert TensorProto.FLOAT16 not in {i.data_type for i in bf16.graph.initializer}

    check_attention_fusable(half, TensorProto.FLOAT16)
    check_attention_fusable(bf16, TensorProto.BFLOAT16)

    exports = {"float32": float32_onnx, **paths}
    for precision, dtype in (("fp16", "float32"), ("bf16", "float32"), ("fp32", "float16"), ("bf16", "float16")):
        with pytest.raises(ValueError, match=f"is a {dtype} export"):
            build_engine(exports[dtype], tmp_path / "engine.plan", precision=precision)
    assert not (tmp_path / "engine.plan").exists()


def check_attention_fusable(proto, half: int) -> None:
    """Every attention of a half-precision export is TensorRT's fusable chain, all in `half`, no Cast
    inside: q scaled (Mul) before MatMul(q, k^T), the mask Add, Softmax, MatMul(p, v). So no
    float32 [heads, L, L] score tensor is written into the graph."""
    import onnx

    typed = onnx.shape_inference.infer_shapes(proto)
    types = {v.name: v.type.tensor_type.elem_type for v in (*typed.graph.value_info, *typed.graph.input)}
    producer = {out: node for node in typed.graph.node for out in node.output}
    consumers: dict[str, list] = {}
    for node in typed.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    softmaxes = [n for n in typed.graph.node if n.op_type == "Softmax"]
    assert softmaxes
    for softmax in softmaxes:
        scores = producer[softmax.input[0]]
        if scores.op_type == "Add":  # the key mask
            scores = next(producer[i] for i in scores.input if producer.get(i) and producer[i].op_type == "MatMul")
        assert scores.op_type == "MatMul" and types[scores.output[0]] == half
        assert types[softmax.input[0]] == half and types[softmax.output[0]] == half
        assert [n.op_type for n in consumers[softmax.output[0]]] == ["MatMul"]
        scaled_q = producer[scores.input[0]]
        assert scaled_q.op_type == "Cast" and producer[scaled_q.input[0]].op_type == "Mul"


def check_profile_covers(family: str, tower: type["Tower"], settings: dict, profile, grids) -> None:
    """The TensorRT profile names every input of the tower, its (min, opt, max) are ordered, and
    the metadata of each grid of `grids` lies within (min, max)."""
    from triton_vlm.vision.runtime import tensorrt_engine as trt_engine

    shapes = trt_engine.profile_shapes(family, settings, profile)
    assert set(shapes) == set(tower.INPUT_NAMES)
    for name, (lo, mid, hi) in shapes.items():
        assert all(a <= b <= c for a, b, c in zip(lo, mid, hi)), name
    for grid in grids:
        md = tower.encoder_metadata(np.array(grid), settings)
        for name, value in md.items():
            lo, _, hi = shapes[name]
            assert all(a <= v <= b for a, v, b in zip(lo, value.shape, hi)), (grid, name)
