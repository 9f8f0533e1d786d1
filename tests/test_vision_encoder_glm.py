"""GLM vision towers (GLM-4.1V's, shared by GLM-4.6V-Flash, GLMGA and GLM-4.5V; GLM-OCR's): torch
re-implementation, ONNX Runtime export (float32 fused, float16, the unfused TensorRT form) and the
repository build, against transformers.

Oracle: `model.model.get_image_features(pixel_values, image_grid_thw)` and
`get_video_features(pixel_values_videos, video_grid_thw)` (pooler outputs, concatenated in item
order) of tiny random checkpoints (vision depth 2, hidden 32, 2 heads, position-embedding grid 8x8),
with inputs from each checkpoint's own transformers processor. The glm4v and glm_ocr checkpoints
have every parameter drawn at random (the demo writer leaves biases at zero and norm weights at one, which
would hide a missing bias or norm). Error = max |ours - ref| / max |ref|.
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
from triton_vlm.families import get_family
from triton_vlm.families.glm4v.tower import Glm4vTower as g
from triton_vlm.families.glm4v.tower import GlmOcrTower

# Image sizes (width, height) -> the tiny processor's grids: 22x22 (merged 11x11: odd, larger than
# the 8x8 embedding grid), 18x28, 6x6 (smaller than it), 22x14, 72x6.
SINGLE = [(448, 448)]
SIZES = [(448, 448), (517, 333), (56, 56), (200, 300), (90, 1000)]
CASES = {
    "one image": (SINGLE, False),
    "several sizes": (SIZES, False),
    "video": ([], True),  # 4 s at 4 fps: 8 frames -> 4 temporal steps of 6x8
    "images and video": (SIZES[1:3], True),
}


def _randomise_weights(checkpoint) -> None:
    """Add noise to every 1-D vision parameter: the demo writes biases as zeros, norm weights as ones."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.model.visual.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(checkpoint)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from triton_vlm.families.demo import write_demo_checkpoint

    root = tmp_path_factory.mktemp("glm_vision")
    out = {v: write_demo_checkpoint(v, root / v, "tiny") for v in ("glm4v", "glm46v", "glmga", "glm_ocr", "glm4v_moe")}
    _randomise_weights(out["glm4v"])
    _randomise_weights(out["glm_ocr"])
    return out


@pytest.fixture(scope="module")
def oracles(checkpoints):
    return {v: EncoderOracle(path, CASES) for v, path in checkpoints.items()}


@pytest.fixture(scope="module")
def settings(checkpoints):
    return g.read_vision_config(checkpoints["glm4v"])


@pytest.fixture(scope="module")
def repo(checkpoints, tmp_path_factory):
    """A full repository build of the glm4v checkpoint (float32 vision encoder)."""
    from triton_vlm.repository.build import build_repository

    return build_repository(checkpoints["glm4v"], tmp_path_factory.mktemp("glm_repo") / "repository")


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory):
    from triton_vlm.vision.runtime.export import export_onnx

    out = tmp_path_factory.mktemp("glm_onnx")
    return {"glm4v-float16": export_onnx(checkpoints["glm4v"], out / "glm4v-float16.onnx", dtype="float16"),
            **{v: export_onnx(checkpoints[v], out / f"{v}.onnx") for v in ("glm46v", "glmga", "glm4v_moe", "glm_ocr")}}


# ---------------------------------------------------------------------------------------------
# Host metadata and the torch tower
# ---------------------------------------------------------------------------------------------

def test_metadata_equals_transformers_positions_and_rotary(oracles, settings):
    from transformers.vision_utils import get_vision_position_ids

    _, grid, _ = oracles["glm4v"]("images and video")
    frames = np.repeat(np.concatenate([np.ones_like(grid[:, :1]), grid[:, 1:]], 1), grid[:, 0], axis=0)
    md = g.encoder_metadata(grid, settings)
    visual = oracles["glm4v"].model.model.visual
    positions = get_vision_position_ids(torch.from_numpy(frames), settings["spatial_merge_size"])
    cos, sin = visual.rotary_pos_emb(torch.zeros(1), positions)
    np.testing.assert_allclose(md["rotary_cos"], cos.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(md["rotary_sin"], sin.numpy(), rtol=0, atol=1e-6)
    # The sample points, bit-equal to those transformers' Glm4vVisionEmbeddings forms (its formula,
    # from the same position ids); the parity tests below check the resampling itself.
    size = torch.from_numpy(np.repeat(frames[:, 1:], frames.prod(1), axis=0)).float()
    norm = ((positions + 0.5) / size) * 2 - 1
    np.testing.assert_array_equal(md["pos_grid"], norm.flip(1).numpy())
    # one attention group per temporal step, no padding beyond the largest frame
    assert md["full_index"].shape == (len(frames), int((frames[:, 1] * frames[:, 2]).max()))


def test_tower_loads_hf_state_dict_strictly(checkpoints, oracles):
    tower = g.load_tower(checkpoints["glm4v"])  # strict=True inside
    ours, theirs = tower.state_dict(), oracles["glm4v"].model.model.visual.state_dict()
    assert set(ours) == set(theirs)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)


def _torch_tower(tower, settings, pixels, grid) -> np.ndarray:
    md = g.encoder_metadata(grid, settings)
    with torch.no_grad():
        return tower(torch.from_numpy(pixels), *[torch.from_numpy(md[k]) for k in g.METADATA_INPUTS]).numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_tower_matches_hf(case, checkpoints, oracles, settings):
    pixels, grid, ref = oracles["glm4v"](case)
    assert rel_err(_torch_tower(g.load_tower(checkpoints["glm4v"]), settings, pixels, grid), ref) < 1e-5


def test_position_embeddings_matter(checkpoints, oracles, settings):
    """The parity tests see the resampled position embeddings: without them the output moves by
    far more than the tolerance."""
    pixels, grid, ref = oracles["glm4v"]("several sizes")
    tower = g.load_tower(checkpoints["glm4v"])
    with torch.no_grad():
        tower.embeddings.position_embedding.weight.zero_()
    assert rel_err(_torch_tower(tower, settings, pixels, grid), ref) > 1e-3


# GLM-OCR's tower: no position embeddings or post-conv norm, q/k norms, a 3x wider merger.

def test_ocr_tower_loads_hf_state_dict_strictly(checkpoints, oracles):
    tower = GlmOcrTower.load_tower(checkpoints["glm_ocr"])
    ours, theirs = tower.state_dict(), oracles["glm_ocr"].model.model.visual.state_dict()
    assert set(ours) == set(theirs) and any("q_norm" in k for k in ours) and "pos_grid" not in GlmOcrTower.INPUT_NAMES
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)


def _ocr_tower(tower, checkpoints, pixels, grid) -> np.ndarray:
    settings = GlmOcrTower.read_vision_config(checkpoints["glm_ocr"])
    md = GlmOcrTower.encoder_metadata(grid, settings)
    with torch.no_grad():
        return tower(torch.from_numpy(pixels), *[torch.from_numpy(md[k]) for k in GlmOcrTower.METADATA_INPUTS]).numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_ocr_torch_tower_matches_hf(case, checkpoints, oracles):
    pixels, grid, ref = oracles["glm_ocr"](case)
    assert rel_err(_ocr_tower(GlmOcrTower.load_tower(checkpoints["glm_ocr"]), checkpoints, pixels, grid), ref) < 1e-5


def test_ocr_qk_norms_matter(checkpoints, oracles):
    """Without the per-head q/k norms the output moves by far more than the tolerance."""
    pixels, grid, ref = oracles["glm_ocr"]("several sizes")
    tower = GlmOcrTower.load_tower(checkpoints["glm_ocr"])
    for block in tower.blocks:
        block.attn.qk_norm = False
    assert rel_err(_ocr_tower(tower, checkpoints, pixels, grid), ref) > 1e-3


def test_ocr_tensorrt_profile_covers_the_inputs(checkpoints):
    from triton_vlm.vision.runtime.tensorrt_engine import EngineProfile

    check_profile_covers("glm_ocr", GlmOcrTower, GlmOcrTower.read_vision_config(checkpoints["glm_ocr"]),
                         EngineProfile(4, 1024, 4096), ([[1, 64, 64]], [[16, 16, 16]], [[1, 2, 2]] * 1024))


# ---------------------------------------------------------------------------------------------
# ONNX Runtime
# ---------------------------------------------------------------------------------------------

def test_onnx_graph(encoder, onnx_path, settings):
    import onnx

    inputs = {i.name: i for i in encoder.session.get_inputs()}
    assert list(inputs) == list(g.INPUT_NAMES)
    assert all(isinstance(d, str) for name in g.INPUT_NAMES for d in inputs[name].shape[:1])
    assert encoder.family == "glm4v" and get_family(encoder.family).tower_class() is g
    proto = onnx.load(str(onnx_path))
    ops = collections.Counter(n.op_type for n in proto.graph.node)
    assert ops["If"] == settings["depth"]  # fused attention, unmasked when no frame is padded
    (sample,) = [n for n in proto.graph.node if n.op_type == "GridSample"]
    attrs = {a.name: a for a in sample.attribute}
    assert attrs["mode"].s == b"bicubic" and attrs["padding_mode"].s == b"border" and attrs["align_corners"].i == 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_onnx_fp32_matches_hf(case, encoder, oracles):
    pixels, grid, ref = oracles["glm4v"](case)
    out = encoder.encode(pixels, grid)
    assert out.dtype == np.float32
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("case", ["several sizes", "images and video"])
def test_onnx_one_run_with_padded_frames(case, encoder, oracles):
    # Every item in one session run: frames padded to the largest one.
    pixels, grid, ref = oracles["glm4v"](case)
    assert rel_err(encoder._run(pixels, grid, None), ref) < 1e-4


def test_onnx_small_runs(onnx_path, oracles):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    enc = VisionEncoder(onnx_path, intra_op_threads=1, max_patches_per_run=64)
    pixels, grid, ref = oracles["glm4v"]("images and video")
    assert rel_err(enc.encode(pixels, grid), ref) < 1e-4


def test_onnx_fp16_matches_hf(exported, oracles):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    enc = VisionEncoder(exported["glm4v-float16"])
    assert enc.dtype == "float16"
    for case in ("several sizes", "images and video"):
        pixels, grid, ref = oracles["glm4v"](case)
        out = enc.encode(pixels, grid)
        assert out.dtype == np.float32
        assert rel_err(out, ref) < 1e-2, case


@pytest.mark.parametrize("variant", ["glm46v", "glmga", "glm4v_moe", "glm_ocr"])
def test_other_variants_match_hf(variant, exported, oracles):
    import onnx

    from triton_vlm.vision.runtime.encoder import VisionEncoder

    enc = VisionEncoder(exported[variant])
    assert enc.family == variant and enc.tower is (GlmOcrTower if variant == "glm_ocr" else g)
    assert [i.name for i in enc.session.get_inputs()] == list(enc.tower.INPUT_NAMES)
    assert {p.key: p.value for p in onnx.load(str(exported[variant]), load_external_data=False).metadata_props}[
        "family"] == variant
    pixels, grid, ref = oracles[variant]("images and video")
    assert rel_err(enc.encode(pixels, grid), ref) < 1e-4


# ---------------------------------------------------------------------------------------------
# TensorRT's input: the unfused graph and the profile (no GPU here: TensorRT itself is not run)
# ---------------------------------------------------------------------------------------------

def test_unfused_graph_runs_standard_ops_and_matches(onnx_path, settings, oracles, tmp_path):
    cases = {case: oracles["glm4v"](case) for case in ("one image", "images and video")}
    check_unfused_matches(onnx_path, g, settings, cases, tmp_path)


def test_tensorrt_engines_are_built_from_the_export_of_their_precision(checkpoints, onnx_path, tmp_path):
    check_engine_graphs(checkpoints["glm4v"], onnx_path, tmp_path)


def test_tensorrt_profile_covers_the_inputs(settings):
    from triton_vlm.vision.runtime.tensorrt_engine import EngineProfile

    check_profile_covers("glm4v", g, settings, EngineProfile(4, 1024, 4096),
                         ([[1, 64, 64]], [[16, 16, 16]], [[1, 2, 2]] * 1024, [[1, 34, 46]], [[1, 2, 2]]))


# ---------------------------------------------------------------------------------------------
# The repository build
# ---------------------------------------------------------------------------------------------

def test_build_repository_serves_the_glm_tower(repo, checkpoints, encoder, settings):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    config = json.loads((checkpoints["glm4v"] / "config.json").read_text())
    front = text_format.Parse((repo / "vision_encoder" / "config.pbtxt").read_text(), mc.ModelConfig())
    params = {k: v.string_value for k, v in front.parameters.items()}
    assert params["family"] == "glm4v"
    assert int(params["patch_dim"]) == settings["patch_dim"] == 3 * 2 * 14 * 14
    assert int(params["hidden"]) == settings["out_hidden_size"] == config["text_config"]["hidden_size"]
    assert list(front.input[0].dims) == [-1, settings["patch_dim"]]
    encoder.warmup()
    assert encoder.settings == settings and encoder.embedding_rows(np.array([[2, 4, 6]])).tolist() == [12]


def test_served_by_tritonserver(repo, oracles, tmp_path):
    """The build's two encoder models in a real tritonserver: a video (split into frames by the
    front, as the tower allows) and images of several sizes in one request."""
    from tests.servers import running
    from triton_vlm.server.tritonserver import TritonServer

    pixels, grid, ref = oracles["glm4v"]("images and video")
    with running(TritonServer(encoder_models(repo, tmp_path / "repository"), log_file=tmp_path / "tritonserver.log")) as server:
        assert rel_err(encode(server, pixels, grid), ref) < 1e-4
