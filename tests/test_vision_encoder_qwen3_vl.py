"""Qwen3-VL's vision tower (shared by Qwen3-VL-MoE): torch re-implementation, ONNX Runtime export
(float32 fused, float16, the unfused TensorRT form), the torch runtime and the repository build,
against transformers.

Oracle: `model.model.get_image_features` / `get_video_features` of a tiny random checkpoint (depth 4,
hidden 32, 2 heads, an 8 x 8 position table, DeepStack after blocks 1 and 2), each item's rows the
pooler output followed by its DeepStack maps (the contract's `embedding_width`), inputs from the
checkpoint's own processors. Every 1-D vision parameter is randomised (the writer leaves biases at
zero and norm weights at one, which would hide a missing bias or norm).
Error = max |ours - ref| / max |ref|.
"""
from __future__ import annotations

import collections
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.encoder_checks import check_engine_graphs, check_profile_covers, check_unfused_matches, rel_err
from tests.oracle import EncoderOracle
from tests.test_vision_encoder_glm import _randomise_weights
from triton_vlm.families.qwen3_vl.tower import Qwen3VLTower as Q

# Image sizes (width, height) -> grids of 20x28 (merged 10x14, larger than the 8x8 table), 14x10,
# 4x4 (smaller than it), 4x20.
SIZES = [(448, 320), (220, 160), (40, 40), (60, 330)]
CASES = {
    "one image": (SIZES[:1], False),
    "several sizes": (SIZES, False),
    "video": ([], True),  # 4 s at 2 fps: 8 frames -> 4 temporal steps
    "images and video": (SIZES[1:3], True),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from triton_vlm.families.demo import write_demo_checkpoint

    path = write_demo_checkpoint("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl_vision"), "tiny")
    _randomise_weights(path)
    return path


@pytest.fixture(scope="module")
def oracle(checkpoint):
    return EncoderOracle(checkpoint, CASES)


@pytest.fixture(scope="module")
def settings(checkpoint):
    return Q.read_vision_config(checkpoint)


@pytest.fixture(scope="module")
def onnx_path(checkpoint, tmp_path_factory):
    from triton_vlm.vision.runtime.export import export_onnx

    return export_onnx(checkpoint, tmp_path_factory.mktemp("qwen3_vl_onnx") / "encoder.onnx")


@pytest.fixture(scope="module")
def encoder(onnx_path):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    return VisionEncoder(onnx_path)


def _torch_tower(tower, settings, pixels, grid) -> np.ndarray:
    md = Q.encoder_metadata(grid, settings)
    with torch.no_grad():
        return tower(torch.from_numpy(pixels), *[torch.from_numpy(md[k]) for k in Q.METADATA_INPUTS]).numpy()


# ---------------------------------------------------------------------------------------------
# Host metadata and the torch tower
# ---------------------------------------------------------------------------------------------

def test_metadata_equals_transformers(oracle, settings):
    """Rotary tables, the position table's taps and weights (bit-equal), one group per frame."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    _, grid, _ = oracle("images and video")
    md = Q.encoder_metadata(grid, settings)
    visual = oracle.model.model.visual
    frames = np.repeat(np.concatenate([np.ones_like(grid[:, :1]), grid[:, 1:]], 1), grid[:, 0], axis=0)
    cos, sin = visual.rotary_pos_emb(torch.zeros(1), get_vision_position_ids(torch.from_numpy(frames), 2))
    np.testing.assert_allclose(md["rotary_cos"], cos.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(md["rotary_sin"], sin.numpy(), rtol=0, atol=1e-6)
    index, weight = get_vision_interpolation_indices_and_weights(
        torch.from_numpy(grid), settings["pos_side"], "bilinear", align_corners=True, spatial_merge_size=2)
    np.testing.assert_array_equal(md["pos_index"], index.numpy())
    np.testing.assert_array_equal(md["pos_weight"], weight.numpy())
    assert md["full_index"].shape == (len(frames), int((frames[:, 1] * frames[:, 2]).max()))


def test_tower_loads_hf_state_dict_strictly(checkpoint, oracle):
    tower = Q.load_tower(checkpoint)
    ours, theirs = tower.state_dict(), oracle.model.model.visual.state_dict()
    assert set(ours) == set(theirs) and any(k.startswith("deepstack_merger_list.1.") for k in ours)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_tower_matches_hf(case, checkpoint, oracle, settings):
    pixels, grid, ref = oracle(case)
    out = _torch_tower(Q.load_tower(checkpoint), settings, pixels, grid)
    assert out.shape[1] == Q.embedding_width(settings) == 3 * settings["out_hidden_size"]
    assert rel_err(out, ref) < 1e-5


def test_position_table_and_deepstack_mergers_matter(checkpoint, oracle, settings):
    """The parity tests see the resampled table and each DeepStack merger: zeroing one moves the
    output by far more than the tolerance (a merger: only its own columns)."""
    pixels, grid, ref = oracle("several sizes")
    tower = Q.load_tower(checkpoint)
    with torch.no_grad():
        tower.pos_embed.weight.zero_()
    assert rel_err(_torch_tower(tower, settings, pixels, grid), ref) > 1e-3
    hidden = settings["out_hidden_size"]
    tower = Q.load_tower(checkpoint)
    with torch.no_grad():
        tower.deepstack_merger_list[1].linear_fc2.bias.add_(1.0)
    out = _torch_tower(tower, settings, pixels, grid)
    np.testing.assert_allclose(out[:, :2 * hidden], ref[:, :2 * hidden], rtol=0, atol=1e-5)
    assert np.abs(out[:, 2 * hidden:] - ref[:, 2 * hidden:]).max() > 0.5


def test_torch_runtime_matches_hf(checkpoint, oracle):
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    encoder = TorchEncoder(checkpoint)
    pixels, grid, ref = oracle("images and video")
    assert rel_err(encoder.encode(pixels, grid), ref) < 1e-5


# ---------------------------------------------------------------------------------------------
# ONNX Runtime
# ---------------------------------------------------------------------------------------------

def test_onnx_graph(encoder, onnx_path, settings):
    import onnx

    assert [i.name for i in encoder.session.get_inputs()] == list(Q.INPUT_NAMES)
    assert encoder.family == "qwen3_vl" and encoder.tower is Q
    ops = collections.Counter(n.op_type for n in onnx.load(str(onnx_path)).graph.node)
    assert ops["If"] == settings["depth"]  # fused attention, unmasked when no frame is padded


@pytest.mark.parametrize("case", sorted(CASES))
def test_onnx_fp32_matches_hf(case, encoder, oracle):
    pixels, grid, ref = oracle(case)
    out = encoder.encode(pixels, grid)
    assert out.dtype == np.float32
    assert rel_err(out, ref) < 1e-4


def test_onnx_runs_batched_and_split(onnx_path, encoder, oracle):
    """Every item in one run (frames padded to the largest), and in runs of at most 64 patches."""
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    pixels, grid, ref = oracle("images and video")
    assert rel_err(encoder._run(pixels, grid, None), ref) < 1e-4
    assert rel_err(VisionEncoder(onnx_path, intra_op_threads=1, max_patches_per_run=64).encode(pixels, grid), ref) < 1e-4


def test_onnx_fp16_matches_hf(checkpoint, oracle, tmp_path):
    from triton_vlm.vision.runtime.encoder import VisionEncoder
    from triton_vlm.vision.runtime.export import export_onnx

    enc = VisionEncoder(export_onnx(checkpoint, tmp_path / "float16.onnx", dtype="float16"))
    pixels, grid, ref = oracle("images and video")
    assert rel_err(enc.encode(pixels, grid), ref) < 1e-2


# ---------------------------------------------------------------------------------------------
# TensorRT's input: the unfused graph and the profile (no GPU here: TensorRT itself is not run)
# ---------------------------------------------------------------------------------------------

def test_unfused_graph_runs_standard_ops_and_matches(onnx_path, settings, oracle, tmp_path):
    check_unfused_matches(onnx_path, Q, settings, {c: oracle(c) for c in ("one image", "images and video")}, tmp_path)


def test_tensorrt_engines_are_built_from_the_export_of_their_precision(checkpoint, onnx_path, tmp_path):
    check_engine_graphs(checkpoint, onnx_path, tmp_path)


def test_tensorrt_profile_covers_the_inputs(settings):
    from triton_vlm.vision.runtime.tensorrt_engine import EngineProfile

    check_profile_covers("qwen3_vl", Q, settings, EngineProfile(4, 1024, 4096),
                         ([[1, 64, 64]], [[16, 16, 16]], [[1, 2, 2]] * 1024, [[1, 34, 46]], [[1, 2, 2]]))
