"""The float32 ONNX tower's fused attention (`com.microsoft::MultiHeadAttention`, unmasked when
every group is full) and its standard-op form for TensorRT (`unfuse_attention`)."""
from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch

from tests.encoder_checks import rel_err, unfused_copy


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory):

    from triton_vlm.vision.runtime.export import export_onnx

    out = tmp_path_factory.mktemp("fused")
    paths = {dt: export_onnx(tiny_checkpoint, out / f"{dt}.onnx", dtype=dt) for dt in ("float32", "float16")}
    paths["unfused"] = unfused_copy(paths["float32"], out / "unfused.onnx")
    return paths


def _session(path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _grids(settings):
    edge = settings["window_size"] // settings["patch_size"]  # window edge in patches
    m = settings["spatial_merge_size"]
    return {
        "full windows, one frame": [[1, 2 * edge, 2 * edge]],  # no padding anywhere: flash path
        "two frames, full windows": [[2, edge, edge]],
        "partial windows": [[1, edge + m, 2 * edge + 2 * m]],
        "two sizes (padded frames)": [[1, edge, edge], [1, m, 2 * m]],
    }


def test_float32_graph_has_fused_attention_under_if_float16_does_not(exported):
    import onnx

    proto = onnx.load(str(exported["float32"]))
    ops = collections.Counter(n.op_type for n in proto.graph.node)
    meta = {p.key: p.value for p in proto.metadata_props}
    depth = json.loads(meta["vision_config"])["depth"]
    assert ops["If"] == depth
    branches = [n for node in proto.graph.node if node.op_type == "If" for a in node.attribute for n in a.g.node]
    assert {(n.domain, n.op_type) for n in branches} == {("com.microsoft", "MultiHeadAttention")}
    # the masked branch passes the key padding mask, the other none (ORT's CPU flash attention)
    assert sorted(len([i for i in n.input if i]) for n in branches) == [3] * depth + [4] * depth
    fp16 = onnx.load(str(exported["float16"]))
    assert not any(n.domain == "com.microsoft" or n.op_type == "If" for n in fp16.graph.node)
    assert proto.ir_version <= 11


@pytest.mark.parametrize("case", ["full windows, one frame", "two frames, full windows", "partial windows",
                                  "two sizes (padded frames)"])
def test_fused_and_unfused_match_the_torch_tower(exported, tiny_checkpoint, case):
    from triton_vlm.families.qwen2_5_vl.tower import Qwen2_5_VLTower as q
    from triton_vlm.vision.tower import attention_groups

    settings = q.read_vision_config(tiny_checkpoint)
    grid = np.array(_grids(settings)[case], dtype=np.int64)
    rng = np.random.default_rng(7)
    pixels = rng.standard_normal((attention_groups.num_patches(grid), settings["patch_dim"])).astype(np.float32)
    md = q.encoder_metadata(grid, settings)
    tower = q.load_tower(tiny_checkpoint)
    with torch.no_grad():
        ref = tower(torch.from_numpy(pixels), *[torch.from_numpy(md[k]) for k in q.METADATA_INPUTS]).numpy()
    padded = bool((md["window_mask"] < 0).any() or (md["full_mask"] < 0).any())
    assert padded == (case in ("partial windows", "two sizes (padded frames)"))
    for which in ("float32", "unfused"):
        session = _session(exported[which])
        names = {i.name for i in session.get_inputs()}
        feeds = {"pixel_values": pixels, **{k: v for k, v in md.items() if k in names}}
        out = session.run(None, feeds)[0]
        assert rel_err(out, ref) < 1e-4, (which, rel_err(out, ref))
