"""Export a checkpoint's vision tower to ONNX (TorchScript exporter, opset 17, dynamic sizes).

The ONNX file carries what the runtime needs in its metadata (`family`, `vision_config`,
`dtype`), so `VisionEncoder` opens it without the checkpoint.
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

from triton_vlm.families import detect_family

OPSET = 17
_DTYPES = ("float32", "float16", "bfloat16")


def export_onnx(checkpoint_dir: str | Path, out_path: str | Path, dtype: str = "float32") -> Path:
    """Write the vision tower of `checkpoint_dir` to `out_path` as ONNX and return the path.

    Inputs: `pixel_values` FP32 [N, patch_dim] and the family's metadata inputs (see the tower
    module); output `embeddings` FP32 [N / merge^2, out_hidden]. `dtype` is the compute/weight
    dtype inside the graph ("float32", "float16" or "bfloat16"); inputs and output stay FP32, and
    the residual stream, norms and rotary compute in float32 whatever `dtype` is (as the torch
    tower does); a float16 / bfloat16 graph's attention is TensorRT's fusable chain in `dtype`
    (`tower_layers.group_attention`).
    ONNX Runtime's CPU provider runs float32 and float16 graphs; bfloat16 graphs are for TensorRT.
    Float32 graphs use ONNX Runtime's fused `com.microsoft::MultiHeadAttention` (its CPU kernel),
    masked only when some group is padded (`mask_only_when_padded`); `unfuse_attention` gives the
    standard-op form (the TensorRT build uses it).
    """
    import onnx
    import torch

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, not {dtype!r}")
    detected = detect_family(checkpoint_dir)
    family, tower = detected.name, detected.tower_class()
    settings = tower.read_vision_config(checkpoint_dir)
    model = tower.load_tower(checkpoint_dir, getattr(torch, dtype))
    pixels, metadata = tower.example_inputs(settings)
    args = (torch.from_numpy(pixels),) + tuple(torch.from_numpy(metadata[k]) for k in tower.METADATA_INPUTS)

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # The TorchScript exporter is chosen on purpose (it exports this graph as is, opset 17, no
    # onnxscript needed); silence its deprecation notice.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, args, str(out_path), dynamo=False, opset_version=OPSET,
                          input_names=list(tower.INPUT_NAMES), output_names=[tower.OUTPUT_NAME],
                          dynamic_axes=tower.dynamic_axes(), do_constant_folding=True,
                          custom_opsets={"com.microsoft": 1})
    # Record what the runtime needs; large models keep their external data where it is.
    proto = onnx.load(str(out_path), load_external_data=False)
    mask_only_when_padded(proto)
    meta = {"family": family, "vision_config": json.dumps(settings), "dtype": dtype,
            "export_seconds": f"{time.perf_counter() - start:.3f}"}
    for prop in list(proto.metadata_props):
        if prop.key in meta:
            proto.metadata_props.remove(prop)
    for key, value in meta.items():
        proto.metadata_props.add(key=key, value=value)
    onnx.save(proto, str(out_path))
    return out_path


_MHA = ("com.microsoft", "MultiHeadAttention")
_COND_PREFIX = "/any_padding_"


def _is_mha(node) -> bool:
    return (node.domain, node.op_type) == _MHA


def mask_only_when_padded(proto) -> int:
    """Put every masked `MultiHeadAttention` node (q, k, v, no bias, key padding mask) of `proto`
    under an `If`: when every group of the call is full (e.g. 448x448 windows, one frame per
    full-attention run) the node runs without its key padding mask, which lets ONNX Runtime's CPU
    kernel take its flash-attention path (no [G, heads, L, L] score tensor); otherwise it runs as
    exported. The condition is computed in the graph from the valid key counts. Returns how many
    nodes were wrapped."""
    from onnx import TensorProto, helper

    graph = proto.graph
    nodes = list(graph.node)
    if not any(_is_mha(n) and len(n.input) > 4 and n.input[4] for n in nodes):
        return 0
    graph.ClearField("node")

    def branch(node, name):
        return helper.make_graph([node], name, [], [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)])

    conds: dict[tuple[str, str], str] = {}
    wrapped = 0
    for k, node in enumerate(nodes):
        if not (_is_mha(node) and len(node.input) > 4 and node.input[4]):
            graph.node.append(node)
            continue
        q, key, v, lengths = node.input[0], node.input[1], node.input[2], node.input[4]
        cond = conds.get((lengths, key))
        if cond is None:  # any group shorter than the padded length?
            p = f"{_COND_PREFIX}{len(conds)}/"
            graph.node.extend([
                helper.make_node("ReduceMin", [lengths], [p + "min"], keepdims=0),
                helper.make_node("Cast", [p + "min"], [p + "min64"], to=TensorProto.INT64),
                helper.make_node("Shape", [key], [p + "len1"], start=1, end=2),
                helper.make_node("ReduceMax", [p + "len1"], [p + "len"], keepdims=0),
                helper.make_node("Less", [p + "min64", p + "len"], [p + "cond"]),
            ])
            cond = conds[(lengths, key)] = p + "cond"
        out = node.output[0]
        attrs = list(node.attribute)
        masked = helper.make_node("MultiHeadAttention", [q, key, v, "", lengths], [out + "/masked"],
                                  domain="com.microsoft")
        masked.attribute.extend(attrs)
        plain = helper.make_node("MultiHeadAttention", [q, key, v], [out + "/unmasked"], domain="com.microsoft")
        plain.attribute.extend(attrs)
        graph.node.append(helper.make_node("If", [cond], [out], name=f"/masked_if_padded_{k}",
                                           then_branch=branch(masked, f"masked_{k}"),
                                           else_branch=branch(plain, f"unmasked_{k}")))
        wrapped += 1
    return wrapped


def unfuse_attention(proto) -> bool:
    """Rewrite, in place, every `com.microsoft::MultiHeadAttention` node of an exported tower
    (inputs q, k, v [G, L, dim], no bias, optional key padding mask = valid key count int32 [G]) into
    standard ONNX opset-17 ops (Reshape / Transpose / MatMul / Softmax with an additive key mask),
    for runtimes without ONNX Runtime's contrib ops (TensorRT). Returns whether anything changed.
    Works on a model loaded with or without its external data."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = proto.graph
    nodes = []
    for node in graph.node:  # undo `mask_only_when_padded`: the masked branch is the general form
        if node.op_type == "If" and any(_is_mha(n) for a in node.attribute for n in a.g.node):
            masked = next(a.g.node[0] for a in node.attribute if a.name == "then_branch")
            masked.output[0] = node.output[0]
            nodes.append(masked)
        elif not node.output[0].startswith(_COND_PREFIX):
            nodes.append(node)
    fused = [n for n in nodes if _is_mha(n)]
    if not fused:
        return False
    graph.ClearField("node")
    consts = {
        "_ua_zero": np.array(0, np.int64), "_ua_one": np.array(1, np.int64),
        "_ua_fzero": np.array(0.0, np.float32),
        "_ua_ax0": np.array([0], np.int64), "_ua_ax1": np.array([1], np.int64),
        "_ua_ax12": np.array([1, 2], np.int64), "_ua_flat": np.array([0, 0, -1], np.int64),
        "_ua_fone": np.array(1.0, np.float32),
    }
    for name, value in consts.items():
        graph.initializer.append(numpy_helper.from_array(value, name))
    for k, node in enumerate(nodes):
        if node not in fused:
            graph.node.append(node)
            continue
        q, key, v = node.input[0], node.input[1], node.input[2]
        lengths = node.input[4] if len(node.input) > 4 and node.input[4] else None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        heads = int(attrs["num_heads"])
        p = f"/unfused_attention_{k}/"
        add = graph.node.append
        heads_shape = p + "heads_shape"
        graph.initializer.append(numpy_helper.from_array(np.array([0, 0, heads, -1], np.int64), heads_shape))
        add(helper.make_node("Reshape", [q, heads_shape], [p + "q4"]))
        add(helper.make_node("Reshape", [key, heads_shape], [p + "k4"]))
        add(helper.make_node("Reshape", [v, heads_shape], [p + "v4"]))
        add(helper.make_node("Transpose", [p + "q4"], [p + "q"], perm=[0, 2, 1, 3]))
        add(helper.make_node("Transpose", [p + "k4"], [p + "kt"], perm=[0, 2, 3, 1]))
        add(helper.make_node("Transpose", [p + "v4"], [p + "v"], perm=[0, 2, 1, 3]))
        head_dim_scale = p + "scale"
        add(helper.make_node("Shape", [p + "q4"], [p + "hd"], start=3, end=4))
        add(helper.make_node("Cast", [p + "hd"], [p + "hdf"], to=1))
        add(helper.make_node("Sqrt", [p + "hdf"], [p + "sqrt_hd"]))
        add(helper.make_node("Div", ["_ua_fone", p + "sqrt_hd"], [head_dim_scale]))
        add(helper.make_node("MatMul", [p + "q", p + "kt"], [p + "qk"]))
        add(helper.make_node("Mul", [p + "qk", head_dim_scale], [p + "scaled" if lengths else p + "scores"]))
        if lengths:  # additive key mask [G, 1, 1, L] from the valid key counts
            graph.initializer.append(numpy_helper.from_array(
                np.array(attrs.get("mask_filter_value", -10000.0), np.float32), p + "mask_value"))
            add(helper.make_node("Shape", [key], [p + "len1"], start=1, end=2))
            add(helper.make_node("Squeeze", [p + "len1", "_ua_ax0"], [p + "len"]))
            add(helper.make_node("Range", ["_ua_zero", p + "len", "_ua_one"], [p + "slots"]))
            add(helper.make_node("Cast", [lengths], [p + "lengths64"], to=7))
            add(helper.make_node("Unsqueeze", [p + "slots", "_ua_ax0"], [p + "slots2"]))
            add(helper.make_node("Unsqueeze", [p + "lengths64", "_ua_ax1"], [p + "lengths2"]))
            add(helper.make_node("Less", [p + "slots2", p + "lengths2"], [p + "valid"]))
            add(helper.make_node("Where", [p + "valid", "_ua_fzero", p + "mask_value"], [p + "mask2"]))
            add(helper.make_node("Unsqueeze", [p + "mask2", "_ua_ax12"], [p + "mask"]))
            add(helper.make_node("Add", [p + "scaled", p + "mask"], [p + "scores"]))
        add(helper.make_node("Softmax", [p + "scores"], [p + "probs"], axis=-1))
        add(helper.make_node("MatMul", [p + "probs", p + "v"], [p + "ctx"]))
        add(helper.make_node("Transpose", [p + "ctx"], [p + "ctx_t"], perm=[0, 2, 1, 3]))
        add(helper.make_node("Reshape", [p + "ctx_t", "_ua_flat"], list(node.output)))
    for opset in list(proto.opset_import):
        if opset.domain == "com.microsoft":
            proto.opset_import.remove(opset)
    return True
