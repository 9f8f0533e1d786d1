"""MiniCPM-V 4.6 vision tower: torch re-implementation, ONNX Runtime export (float32 fused, float16,
the unfused TensorRT form) and the repository build, against transformers.

Oracle: `model.model.get_image_features(pixel_values, target_sizes)` and
`get_video_features(pixel_values_videos, target_sizes_videos)` (pooler outputs, concatenated in
slice order) of the tiny demo checkpoint (vision hidden 32, 2 layers, window merger after layer 0,
position-embedding grid 16x16, slices of at most 112 pixels a side), with every 1-D vision
parameter moved off its initial value (the demo writer leaves biases at zero and norm weights at
one, which would hide a missing bias or norm) and inputs from the checkpoint's own processor.
transformers' packed `pixel_values` become the tower's rows with `minicpmv.patch_rows`, its
`target_sizes` the `grid_thw` rows [1, h, w]. Error = max |ours - ref| / max |ref|.
"""
from __future__ import annotations

import collections
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.encoder_checks import (check_engine_graphs, check_profile_covers, check_unfused_matches, encode,
                                  encoder_models, rel_err)
from tests.oracle import EncoderOracle
from triton_vlm.errors import InvalidInput
from triton_vlm.families import get_family
from triton_vlm.families.minicpmv import tower_v4_6 as mc
from triton_vlm.families.minicpmv.tower_v4_6 import MiniCPMV4_6Tower as MC

# Image sizes (width, height); the tiny processor slices them into 8x8, 8x12 / 12x8, 4x16 and
# 4x12 patch grids (the overview image first).
SIZES = [(448, 448), (640, 480), (1920, 1080), (4000, 1000), (200, 100)]
CASES = {
    **{f"{w}x{h}": ([(w, h)], False) for w, h in SIZES},
    "several images": (SIZES, False),
    "video": ([], True),  # 4 s at 2 fps
    "images and video": (SIZES[2:4], True),
}


def grid_of(target_sizes) -> np.ndarray:
    """transformers' `target_sizes` [slices, 2] as `grid_thw` rows [1, h, w]."""
    sizes = np.asarray(target_sizes, dtype=np.int64)
    return np.concatenate([np.ones_like(sizes[:, :1]), sizes], axis=1)


class Oracle(EncoderOracle):
    """MiniCPM-V keeps per-slice sizes in `target_sizes` and packs pixels [B, C, patch, L]."""

    image_grid_key, video_grid_key = "target_sizes", "target_sizes_videos"

    def rows(self, pixel_values: torch.Tensor) -> np.ndarray:
        return mc.patch_rows(pixel_values.numpy())

    def grid(self, grid: torch.Tensor) -> np.ndarray:
        return grid_of(grid)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny demo checkpoint with noise added to every 1-D vision / merger parameter."""
    from transformers import AutoModelForImageTextToText

    from triton_vlm.families.demo import write_demo_checkpoint

    path = write_demo_checkpoint("minicpmv4_6", tmp_path_factory.mktemp("minicpmv_vision") / "ckpt", "tiny")
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    gen = torch.Generator().manual_seed(3)
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
def settings(checkpoint):
    return MC.read_vision_config(checkpoint)


@pytest.fixture(scope="module")
def repo(checkpoint, tmp_path_factory):
    """A full repository build of the checkpoint (float32 vision encoder)."""
    from triton_vlm.repository.build import build_repository

    return build_repository(checkpoint, tmp_path_factory.mktemp("minicpmv_repo") / "repository")


# ---------------------------------------------------------------------------------------------
# Input convention and host metadata
# ---------------------------------------------------------------------------------------------

def test_patch_rows_are_the_patch_embedding_patches():
    """Row k is patch k of the packed sequence in the Conv2d weight's [C, ph, pw] order; frames
    (dim 0) follow one another as `get_video_features` packs them."""
    packed = np.random.default_rng(0).standard_normal((2, 3, 14, 14 * 5)).astype(np.float32)
    rows = mc.patch_rows(packed)
    joined = torch.from_numpy(packed).permute(1, 2, 0, 3).reshape(1, 3, 14, -1).numpy()  # get_video_features
    assert rows.shape == (10, 3 * 14 * 14)
    for k in range(10):
        np.testing.assert_array_equal(rows[k], joined[0, :, :, 14 * k:14 * (k + 1)].reshape(-1))


def test_settings(settings, checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert settings["patch_dim"] == 3 * 14 * 14 and settings["spatial_merge_size"] == 4
    assert settings["out_hidden_size"] == config["text_config"]["hidden_size"]
    assert settings["insert_layer_id"] == config["insert_layer_id"] == 0
    assert MC.vision_settings({**config, "downsample_mode": "4x"})["spatial_merge_size"] == 2  # no window merger
    with pytest.raises(ValueError, match="downsample_mode must be"):
        MC.vision_settings({**config, "downsample_mode": "8x"})


@pytest.mark.parametrize("side", [16, 32, 70, 27])
def test_position_ids_equal_transformers(side):
    from transformers.vision_utils import get_vision_nearest_position_ids

    sizes = [(h, w) for h in (1, 3, 4, 8, 12, 16, 40, 97, 100) for w in (4, 12, 70, 71)]
    ref = get_vision_nearest_position_ids(torch.tensor(sizes), side).numpy()
    ours = np.concatenate([(mc.nearest_buckets(h, side)[:, None] * side + mc.nearest_buckets(w, side)).reshape(-1)
                           for h, w in sizes])
    np.testing.assert_array_equal(ours, ref)


def test_metadata_orders_patches_by_transformers_windows(oracle, settings):
    """`patch_order` puts each transformers window (`get_vision_window_index`, 2x2 patches,
    row-major inside) on four adjacent rows, and gives every row its nearest-bucket position id."""
    from transformers.vision_utils import get_vision_nearest_position_ids, get_vision_window_index

    _, grid, _ = oracle("images and video")
    md = MC.encoder_metadata(grid, settings)
    ref_windows, _ = get_vision_window_index(torch.from_numpy(grid), spatial_merge_size=1, window_size=2, patch_size=1)
    assert sorted(map(tuple, md["patch_order"].reshape(-1, 4).tolist())) == \
        sorted(map(tuple, ref_windows.numpy().reshape(-1, 4).tolist()))
    positions = get_vision_nearest_position_ids(torch.from_numpy(grid[:, 1:]), settings["pos_embed_size"]).numpy()
    np.testing.assert_array_equal(md["position_ids"], positions[md["patch_order"]])
    # one attention group per slice, before and after the window merger
    assert md["full_index"].shape == (len(grid), int((grid[:, 1] * grid[:, 2]).max()))
    assert md["merged_index"].shape == (len(grid), int((grid[:, 1] * grid[:, 2]).max()) // 4)


def test_tower_loads_hf_state_dict_strictly(checkpoint, oracle):
    tower = MC.load_tower(checkpoint)  # strict=True inside
    theirs = {f"{name}.{k}": v for name in ("vision_tower", "merger")
              for k, v in getattr(oracle.model.model, name).state_dict().items()}
    ours = tower.state_dict()
    assert set(ours) == set(theirs)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_tower_matches_hf(case, checkpoint, oracle, settings):
    pixels, grid, ref = oracle(case)
    md = MC.encoder_metadata(grid, settings)
    with torch.no_grad():
        out = MC.load_tower(checkpoint)(torch.from_numpy(pixels),
                                        *[torch.from_numpy(md[k]) for k in MC.METADATA_INPUTS]).numpy()
    assert rel_err(out, ref) < 1e-5


# ---------------------------------------------------------------------------------------------
# ONNX Runtime
# ---------------------------------------------------------------------------------------------

def test_onnx_graph(encoder, onnx_path, settings):
    import onnx

    assert [i.name for i in encoder.session.get_inputs()] == list(MC.INPUT_NAMES)
    assert encoder.family == "minicpmv4_6" and get_family(encoder.family).tower_class() is MC and encoder.embedding_rows(np.array([[1, 8, 12]])).tolist() == [6]
    proto = onnx.load(str(onnx_path))
    ops = collections.Counter((n.domain, n.op_type) for n in proto.graph.node)
    # window attention: one unmasked fused node; slice attention: masked only when padded
    assert ops[("com.microsoft", "MultiHeadAttention")] == 1
    assert ops[("", "If")] == settings["depth"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_onnx_fp32_matches_hf(case, encoder, oracle):
    pixels, grid, ref = oracle(case)
    out = encoder.encode(pixels, grid)
    assert out.dtype == np.float32
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("case", ["several images", "images and video"])
def test_onnx_one_run_with_padded_slices(case, encoder, oracle):
    # every slice in one session run: slices padded to the largest one
    pixels, grid, ref = oracle(case)
    assert rel_err(encoder._run(pixels, grid, None), ref) < 1e-4


def test_onnx_small_runs(onnx_path, oracle):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    enc = VisionEncoder(onnx_path, intra_op_threads=1, max_patches_per_run=64)
    pixels, grid, ref = oracle("several images")
    assert rel_err(enc.encode(pixels, grid), ref) < 1e-4


def test_onnx_fp16_matches_hf(checkpoint, oracle, tmp_path):
    from triton_vlm.vision.runtime.encoder import VisionEncoder
    from triton_vlm.vision.runtime.export import export_onnx

    enc = VisionEncoder(export_onnx(checkpoint, tmp_path / "float16.onnx", dtype="float16"))
    assert enc.dtype == "float16"
    for case in ("several images", "images and video"):
        pixels, grid, ref = oracle(case)
        out = enc.encode(pixels, grid)
        assert out.dtype == np.float32
        assert rel_err(out, ref) < 1e-2, case


def test_bad_grid_is_refused(encoder, oracle):
    pixels, grid, _ = oracle("448x448")
    bad = grid.copy()
    bad[0, 1:] = (2, 32)  # as many patches as 8x8, h not a multiple of 4
    with pytest.raises(InvalidInput, match=r"grid_thw\[0\].*multiples of 4"):
        encoder.encode(pixels, bad)


# ---------------------------------------------------------------------------------------------
# TensorRT's input: the unfused graph and the profile (no GPU here: TensorRT itself is not run)
# ---------------------------------------------------------------------------------------------

def test_unfused_graph_runs_standard_ops_and_matches(onnx_path, settings, oracle, tmp_path):
    cases = {case: oracle(case) for case in ("448x448", "images and video")}
    check_unfused_matches(onnx_path, MC, settings, cases, tmp_path)


def test_tensorrt_engines_are_built_from_the_export_of_their_precision(checkpoint, onnx_path, tmp_path):
    check_engine_graphs(checkpoint, onnx_path, tmp_path)


def test_tensorrt_profile_covers_the_inputs(settings):
    from triton_vlm.vision.runtime.tensorrt_engine import EngineProfile

    grids = ([[1, 64, 64]], [[16, 16, 16]], [[1, 4, 4]] * 256, [[1, 32, 32]], [[1, 4, 4]], [[1, 8, 12], [1, 4, 16]])
    check_profile_covers("minicpmv4_6", MC, settings, EngineProfile(16, 1024, 4096), grids)


# ---------------------------------------------------------------------------------------------
# The repository build
# ---------------------------------------------------------------------------------------------

def test_build_repository_serves_the_minicpmv_tower(repo, checkpoint, encoder, settings):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc_pb

    config = json.loads((checkpoint / "config.json").read_text())
    front = text_format.Parse((repo / "vision_encoder" / "config.pbtxt").read_text(), mc_pb.ModelConfig())
    params = {k: v.string_value for k, v in front.parameters.items()}
    assert params["family"] == "minicpmv4_6"
    assert params["spatial_merge_size"] == "4"
    assert int(params["patch_dim"]) == settings["patch_dim"]
    assert int(params["hidden"]) == settings["out_hidden_size"] == config["text_config"]["hidden_size"]
    assert list(front.input[0].dims) == [-1, settings["patch_dim"]]
    encoder.warmup()
    assert encoder.settings == settings


def test_served_by_tritonserver(repo, oracle, tmp_path):
    """The build's two encoder models in a real tritonserver: images of several sizes (their
    slices) and a video in one request."""
    from tests.servers import running
    from triton_vlm.server.tritonserver import TritonServer

    pixels, grid, ref = oracle("images and video")
    with running(TritonServer(encoder_models(repo, tmp_path / "repository"), log_file=tmp_path / "tritonserver.log")) as server:
        assert rel_err(encode(server, pixels, grid), ref) < 1e-4
