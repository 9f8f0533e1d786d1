"""Qwen3.5's vision tower (`Qwen3_5VisionModel`, shared by Qwen3.5-MoE): Qwen3-VL's without
DeepStack. The torch re-implementation, the torch runtime and the ONNX Runtime export (float32,
one run and split runs; the unfused graph TensorRT takes, and its profile) against transformers, on the tiny random checkpoint with every 1-D vision
parameter randomised (as `tests/test_vision_encoder_qwen3_vl.py`, whose cases these are).
Error = max |ours - ref| / max |ref|.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests.encoder_checks import rel_err
from tests.oracle import EncoderOracle
from tests.test_vision_encoder_qwen3_vl import CASES, randomised_checkpoint
from triton_vlm.families.qwen3_vl.tower import Qwen3_5Tower as Q


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return randomised_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5_vision"))


@pytest.fixture(scope="module")
def oracle(checkpoint):
    return EncoderOracle(checkpoint, CASES)


@pytest.fixture(scope="module")
def onnx_path(checkpoint, tmp_path_factory):
    from triton_vlm.vision.runtime.export import export_onnx

    return export_onnx(checkpoint, tmp_path_factory.mktemp("qwen3_5_onnx") / "encoder.onnx")


def test_tower_loads_hf_state_dict_strictly_and_has_no_deepstack(checkpoint, oracle):
    tower = Q.load_tower(checkpoint)
    ours, theirs = tower.state_dict(), oracle.model.model.visual.state_dict()
    assert set(ours) == set(theirs) and not any(k.startswith("deepstack") for k in ours)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)
    settings = Q.read_vision_config(checkpoint)
    assert settings["deepstack_visual_indexes"] == [] and Q.embedding_width(settings) == settings["out_hidden_size"]


def test_a_deepstack_key_is_refused_by_name(checkpoint):
    """Qwen3.5's model never reads `deepstack_visual_indexes`: a config giving some is refused."""
    import json

    vision = json.loads((checkpoint / "config.json").read_text())["vision_config"]
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        Q.vision_settings({**vision, "deepstack_visual_indexes": [1]})
    assert Q.vision_settings({**vision, "deepstack_visual_indexes": []})["deepstack_visual_indexes"] == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_runtime_matches_hf(case, checkpoint, oracle):
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    pixels, grid, ref = oracle(case)
    out = TorchEncoder(checkpoint).encode(pixels, grid)
    assert out.shape == ref.shape and rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_onnx_fp32_matches_hf(case, onnx_path, oracle):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    encoder = VisionEncoder(onnx_path)
    assert encoder.family == "qwen3_5" and encoder.tower is Q
    pixels, grid, ref = oracle(case)
    assert rel_err(encoder.encode(pixels, grid), ref) < 1e-4


def test_onnx_runs_batched_and_split(onnx_path, oracle):
    """Every item in one run (frames padded to the largest), and in runs of at most 64 patches."""
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    pixels, grid, ref = oracle("images and video")
    assert rel_err(VisionEncoder(onnx_path)._run(pixels, grid, None), ref) < 1e-4
    assert rel_err(VisionEncoder(onnx_path, intra_op_threads=1, max_patches_per_run=64).encode(pixels, grid), ref) < 1e-4


# TensorRT's input: the unfused graph and the profile (no GPU here: TensorRT itself is not run)

def test_unfused_graph_runs_standard_ops_and_matches(onnx_path, checkpoint, oracle, tmp_path):
    from tests.encoder_checks import check_unfused_matches

    check_unfused_matches(onnx_path, Q, Q.read_vision_config(checkpoint),
                          {c: oracle(c) for c in ("one image", "images and video")}, tmp_path)


def test_tensorrt_profile_covers_the_inputs(checkpoint):
    from tests.encoder_checks import check_profile_covers
    from triton_vlm.vision.runtime.tensorrt_engine import EngineProfile

    check_profile_covers("qwen3_5", Q, Q.read_vision_config(checkpoint), EngineProfile(4, 1024, 4096),
                         ([[1, 64, 64]], [[16, 16, 16]], [[1, 2, 2]] * 1024, [[1, 34, 46]], [[1, 2, 2]]))
