"""MiniCPM-V 4.7's vision tower (4.6's, `triton_vlm.families.minicpmv.tower_v4_6`) in both `downsample_mode`s,
and MiniCPM-OCR's (the same, "4x" by default), against transformers: the torch tower
(`TorchEncoder`, the `torch` back end) within 1e-5 and the ONNX export through ONNX Runtime within
1e-4 of `get_image_features` / `get_video_features`.

"16x" runs the window merger after `insert_layer_id` then the 2x2 merger (4 patches a token per
side); "4x" skips the window merger (`use_vit_merger=False`, 2 patches a token per side). The
tiny demo checkpoint of each mode, its 1-D vision parameters moved off their initial values (see
`tests/test_vision_encoder_minicpmv.py`), inputs from its own processors.
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.encoder_checks import check_profile_covers, check_unfused_matches, rel_err
from tests.test_vision_encoder_minicpmv import CASES, Oracle
from triton_vlm.families import get_family
from triton_vlm.families.minicpmv.tower_v4_6 import MiniCPMOcrTower
from triton_vlm.families.minicpmv.tower_v4_6 import MiniCPMV4_6Tower as MC

MODES = {"16x": 4, "4x": 2}  # downsample_mode -> patches per token side
TOWERS = {("minicpmv4_7", "16x"): MC, ("minicpmv4_7", "4x"): MC, ("minicpm_ocr", "4x"): MiniCPMOcrTower}


@pytest.fixture(scope="module", params=list(TOWERS), ids=lambda key: f"{key[0]}-{key[1]}")
def variant(request) -> tuple[str, str]:
    return request.param


@pytest.fixture(scope="module")
def mode(variant) -> str:
    return variant[1]


@pytest.fixture(scope="module")
def checkpoint(variant, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    from triton_vlm.families.demo import write_demo_checkpoint

    family, mode = variant
    path = write_demo_checkpoint(family, tmp_path_factory.mktemp(f"{family}_{mode}") / "ckpt", "tiny",
                                 overrides={"downsample_mode": mode})
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in (model.model.vision_tower, model.model.merger):
            for param in module.parameters():
                if param.ndim == 1:
                    param.add_(0.1 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def oracle(checkpoint):
    return Oracle(checkpoint, CASES)


@pytest.fixture(scope="module")
def onnx_path(checkpoint, tmp_path_factory):
    from triton_vlm.vision.runtime.export import export_onnx

    return export_onnx(checkpoint, tmp_path_factory.mktemp("minicpmv4_7_onnx") / "encoder.onnx")


@pytest.fixture(scope="module")
def onnx_encoder(onnx_path):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    return VisionEncoder(onnx_path)


@pytest.fixture(scope="module")
def torch_encoder(checkpoint):
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    return TorchEncoder(checkpoint)


def test_settings_follow_the_mode(checkpoint, variant, torch_encoder):
    family, mode = variant
    tower = TOWERS[variant]
    settings = tower.read_vision_config(checkpoint)
    assert settings["downsample_mode"] == mode and settings["window_merger"] == (mode == "16x")
    assert settings["spatial_merge_size"] == MODES[mode]
    assert torch_encoder.family == family and get_family(family).tower_class() is tower
    # where config.json leaves the mode out, the config class's default: OCR's "4x", 4.x's "16x"
    config = {k: v for k, v in json.loads((checkpoint / "config.json").read_text()).items() if k != "downsample_mode"}
    assert tower.vision_settings(config)["downsample_mode"] == ("4x" if family == "minicpm_ocr" else "16x")
    assert torch_encoder.embedding_rows(np.array([[1, 8, 12]])).tolist() == [96 // MODES[mode] ** 2]


def test_onnx_graph_drops_the_window_merger_inputs_in_4x(onnx_encoder, mode):
    names = {i.name for i in onnx_encoder.session.get_inputs()}
    merged = {"merged_index", "merged_mask", "merged_inverse"}
    assert merged <= names if mode == "16x" else not merged & names


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_tower_matches_hf(case, oracle, torch_encoder):
    pixels, grid, ref = oracle(case)
    assert rel_err(torch_encoder.encode(pixels, grid), ref) < 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_onnx_matches_hf(case, oracle, onnx_encoder):
    pixels, grid, ref = oracle(case)
    out = onnx_encoder.encode(pixels, grid)
    assert out.dtype == np.float32
    assert rel_err(out, ref) < 1e-4


def test_onnx_one_run_with_padded_slices(oracle, onnx_encoder):
    pixels, grid, ref = oracle("images and video")
    assert rel_err(onnx_encoder._run(pixels, grid, None), ref) < 1e-4


def test_tensorrt_inputs_unfused_graph_and_profile(onnx_path, variant, oracle, tmp_path):
    """What a TensorRT build takes (no TensorRT here): the standard-op graph matches, and the
    profile covers the metadata of slices of every size (in "4x" the `merged_*` shapes name inputs
    the graph does not have: `tensorrt_engine` sets only the network's own)."""
    from triton_vlm.vision.runtime.tensorrt_engine import EngineProfile

    tower = TOWERS[variant]
    settings = tower.read_vision_config(oracle.checkpoint)
    check_unfused_matches(onnx_path, tower, settings, {c: oracle(c) for c in ("448x448", "images and video")}, tmp_path)
    grids = ([[1, 64, 64]], [[1, 4, 4]] * 256, [[1, 32, 32]], [[1, 4, 4]], [[1, 8, 12], [1, 4, 16]])
    check_profile_covers(variant[0], tower, settings, EngineProfile(16, 1024, 4096), grids)
