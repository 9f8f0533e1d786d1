"""Checks shared by the vision-tower test files."""
from __future__ import annotations

from pathlib import Path


def unfused_copy(onnx_path: Path, out_path: Path) -> Path:
    """The form TensorRT parses: the export with attention unfused, checked to hold standard ONNX
    ops only (no `com.microsoft` node, no `If`), saved at `out_path`."""
    import onnx

    from triton_vlm.vision.export import unfuse_attention

    proto = onnx.load(str(onnx_path))
    assert unfuse_attention(proto)
    onnx.checker.check_model(proto)
    assert {n.domain for n in proto.graph.node} == {""} and [o.domain for o in proto.opset_import] == [""]
    assert not any(n.op_type == "If" for n in proto.graph.node)
    onnx.save(proto, str(out_path))
    return out_path
