"""Vision encoder: torch re-implementation and ONNX Runtime export against the HF vision tower.

Oracle: `model.model.visual(pixel_values, grid_thw=grid_thw).pooler_output` of a tiny random
Qwen2.5-VL checkpoint (vision depth 4, hidden 32, 2 heads, full attention in blocks 1 and 3,
window 112 px = 4x4 merge units). Error = max |ours - ref| / max |ref|.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.encoder_checks import check_engine_graphs, check_profile_covers, rel_err
from triton_vlm.errors import InvalidInput
from triton_vlm.families import get_family
from triton_vlm.families.qwen2_5_vl.tower import Qwen2_5_VLTower as q

GRIDS = {
    "640x480": [[1, 34, 46]],  # partial windows on both axes
    "22x36": [[1, 22, 36]],
    "window_multiple": [[1, 16, 16]],  # divides evenly: HF's padding adds an empty row of windows
    "mixed_sizes": [[1, 16, 16], [1, 34, 46], [1, 8, 12], [1, 16, 16]],
    "video_4_frames": [[2, 20, 28]],
    "image_and_video": [[1, 22, 36], [2, 8, 12], [1, 4, 6]],
    "tiny": [[1, 2, 2]],
}


def random_pixels(grid, width, seed=0) -> torch.Tensor:
    g = torch.tensor(grid)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(int(g.prod(1).sum()), width, generator=gen)


@pytest.fixture(scope="session")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="session")
def settings(checkpoint):
    return q.read_vision_config(checkpoint)


@pytest.fixture(scope="session")
def reference(hf_model, settings):
    cache = {}

    def ref(name):
        if name not in cache:
            grid = GRIDS[name]
            px = random_pixels(grid, settings["patch_dim"])
            with torch.no_grad():
                out = hf_model.model.visual(px, grid_thw=torch.tensor(grid)).pooler_output
            cache[name] = (px.numpy(), np.array(grid, dtype=np.int64), out.numpy())
        return cache[name]

    return ref


@pytest.fixture(scope="session")
def onnx_paths(checkpoint, tmp_path_factory):
    from triton_vlm.vision.runtime.export import export_onnx

    out = tmp_path_factory.mktemp("vision_onnx")
    return {dt: export_onnx(checkpoint, out / f"vision_{dt}.onnx", dtype=dt) for dt in ("float32", "float16")}


@pytest.fixture(scope="session")
def encoder(onnx_paths):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    return VisionEncoder(onnx_paths["float32"])


# ---------------------------------------------------------------------------------------------
# Host metadata
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(GRIDS))
def test_metadata_is_consistent(name, settings):
    grid = np.array(GRIDS[name])
    md = q.encoder_metadata(grid, settings)
    n = int(grid.prod(1).sum())
    assert md["rotary_cos"].shape == (n, settings["head_dim"]) and md["rotary_cos"].dtype == np.float32
    for kind in ("window", "full"):
        index, mask, inverse = md[f"{kind}_index"], md[f"{kind}_mask"], md[f"{kind}_inverse"]
        assert index.dtype == np.int64 and inverse.dtype == np.int64 and mask.dtype == np.float32
        assert index.min() >= 0 and index.max() < n  # the -100 pad never reaches a gather
        assert np.isfinite(mask).all() and (mask[:, 0] == 0).all()  # every group has a real key
        # inverse maps every patch to its own slot; padding sits at the end of each group
        np.testing.assert_array_equal(index.reshape(-1)[inverse], np.arange(n))
        valid = mask == 0
        assert valid.sum() == n
        assert (np.diff(valid.astype(np.int8), axis=1) <= 0).all()
    # full attention: one group per frame
    assert md["full_index"].shape[0] == int(grid[:, 0].sum())


def test_metadata_windows_use_ceil_division(settings):
    # 16x16 patches = 8x8 merge units = exactly 2x2 windows of 4x4 units: no empty window.
    md = q.encoder_metadata(np.array([[1, 16, 16]]), settings)
    assert md["window_index"].shape == (4, 64) and (md["window_mask"] == 0).all()
    # 34x46 patches = 17x23 units -> 5x6 windows; the last row holds 1 unit, the last column 3
    # (corner window: 1x3 units = 12 patches).
    md = q.encoder_metadata(np.array([[1, 34, 46]]), settings)
    sizes = (md["window_mask"] == 0).sum(1)
    assert md["window_index"].shape == (30, 64)
    assert sorted(set(sizes.tolist())) == [12, 16, 48, 64] and sizes.sum() == 34 * 46


# ---------------------------------------------------------------------------------------------
# Torch re-implementation
# ---------------------------------------------------------------------------------------------

def test_tower_loads_hf_state_dict_strictly(checkpoint, hf_model):
    tower = q.load_tower(checkpoint)  # strict=True inside
    ours = tower.state_dict()
    theirs = hf_model.model.visual.state_dict()
    assert set(ours) == set(theirs)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["640x480", "mixed_sizes", "video_4_frames", "tiny"])
def test_torch_tower_matches_hf(name, checkpoint, settings, reference):
    px, grid, ref = reference(name)
    tower = q.load_tower(checkpoint)
    md = q.encoder_metadata(grid, settings)
    with torch.no_grad():
        out = tower(torch.from_numpy(px), *[torch.from_numpy(md[k]) for k in q.METADATA_INPUTS])
    assert rel_err(out.numpy(), ref) < 1e-5


# ---------------------------------------------------------------------------------------------
# ONNX Runtime
# ---------------------------------------------------------------------------------------------

def test_onnx_graph_is_dynamic(encoder, settings):
    inputs = {i.name: i for i in encoder.session.get_inputs()}
    assert list(inputs) == list(q.INPUT_NAMES)
    assert isinstance(inputs["pixel_values"].shape[0], str) and inputs["pixel_values"].shape[1] == settings["patch_dim"]
    assert all(isinstance(d, str) for d in inputs["window_index"].shape + inputs["full_index"].shape)
    out = encoder.session.get_outputs()[0]
    assert out.name == "embeddings" and out.shape[1] == settings["out_hidden_size"]
    assert encoder.family == "qwen2_5_vl" and get_family(encoder.family).tower_class() is q


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_onnx_fp32_matches_hf(name, encoder, reference):
    px, grid, ref = reference(name)
    out = encoder.encode(px, grid)
    assert out.dtype == np.float32
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("name", ["mixed_sizes", "image_and_video"])
def test_onnx_one_run_with_padded_groups(name, encoder, reference):
    # All items in one session run: groups padded to the largest window / frame.
    px, grid, ref = reference(name)
    assert rel_err(encoder._run(px, grid, None), ref) < 1e-4


@pytest.mark.parametrize("name", ["mixed_sizes", "image_and_video", "video_4_frames"])
def test_onnx_small_runs(name, onnx_paths, reference):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    enc = VisionEncoder(onnx_paths["float32"], intra_op_threads=1, max_patches_per_run=64)
    px, grid, ref = reference(name)
    assert rel_err(enc.encode(px, grid), ref) < 1e-4


def test_zero_items(encoder, settings):
    width = settings["out_hidden_size"]
    for px, grid in [(np.zeros((0, settings["patch_dim"]), np.float32), np.zeros((0, 3), np.int64)),
                     (np.zeros((0, 0), np.float32), np.zeros((0,), np.int64))]:
        out = encoder.encode(px, grid)
        assert out.shape == (0, width) and out.dtype == np.float32


def test_onnx_fp16_matches_hf(onnx_paths, reference):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    enc = VisionEncoder(onnx_paths["float16"])
    for name in ("640x480", "image_and_video", "tiny"):
        px, grid, ref = reference(name)
        out = enc.encode(px, grid)
        assert out.dtype == np.float32
        assert rel_err(out, ref) < 1e-2, name


def test_invalid_inputs(encoder, settings):
    d = settings["patch_dim"]
    grid = np.array([[1, 4, 6]])
    ok = np.zeros((24, d), np.float32)
    cases = [
        (np.zeros((23, d), np.float32), grid, "pixel_values"),   # rows != sum(t*h*w)
        (np.zeros((24, d - 1), np.float32), grid, "pixel_values"),  # wrong width
        (np.zeros((24 * d,), np.float32), grid, "pixel_values"),  # not 2-D
        (ok, np.array([1, 4, 6]), "grid_thw"),                     # not [M, 3]
        (ok, np.array([[1, 4, 6, 1]]), "grid_thw"),
        (ok, np.array([[1.0, 4.0, 6.0]]), "grid_thw"),           # not integers
        (np.zeros((15, d), np.float32), np.array([[1, 3, 5]]), "grid_thw"),  # not multiples of merge
        (np.zeros((0, d), np.float32), np.array([[0, 4, 6]]), "grid_thw"),
    ]
    for px, g, name in cases:
        with pytest.raises(InvalidInput, match=name):
            encoder.encode(px, g)


# ---------------------------------------------------------------------------------------------
# fullatt_block_indexes, the GPU path's pure parts, the generated encoder configs
# ---------------------------------------------------------------------------------------------

def test_fullatt_blocks_are_full_attention_and_matter(checkpoint, settings, reference, encoder):
    """Blocks 1 and 3 attend over the whole frame: the ONNX output matches HF, and a tower that
    ran those blocks with window attention instead would not (so the parity tests see them)."""
    assert settings["fullatt_block_indexes"] == [1, 3]
    px, grid, ref = reference("640x480")  # 30 windows: window and full attention differ
    assert rel_err(encoder.encode(px, grid), ref) < 1e-4
    tower = q.load_tower(checkpoint)
    tower.full_blocks = set()
    md = q.encoder_metadata(grid, settings)
    with torch.no_grad():
        windowed = tower(torch.from_numpy(px), *[torch.from_numpy(md[k]) for k in q.METADATA_INPUTS]).numpy()
    assert rel_err(windowed, ref) > 1e-3  # 10x the parity tolerance (random tiny weights: ~4e-3)


def test_tensorrt_module_imports_without_tensorrt_and_profiles_cover_the_inputs(settings):
    from triton_vlm.vision.runtime.tensorrt_engine import EngineProfile

    # The largest metadata of any grid within max patches fits the profile.
    check_profile_covers("qwen2_5_vl", q, settings, EngineProfile(4, 1024, 4096),
                         ([[1, 64, 64]], [[16, 16, 16]], [[1, 2, 2]] * 1024, [[1, 34, 46]]))
    with pytest.raises(ValueError):
        EngineProfile(8, 4, 16)


def test_tensorrt_engines_are_built_from_the_export_of_their_precision(checkpoint, onnx_paths, tmp_path):
    check_engine_graphs(checkpoint, onnx_paths["float32"], tmp_path)


def test_gpu_build_refuses_a_cpu_graph_dtype(checkpoint, tmp_path):
    from triton_vlm.repository.build import build_repository
    from triton_vlm.repository.options import BuildOptions

    with pytest.raises(ValueError, match="--trt-precision"):
        build_repository(checkpoint, tmp_path / "repository",
                         BuildOptions(device="gpu", encoder_backend="tensorrt", encoder_dtype="float16"))
    assert not (tmp_path / "repository").exists()


def test_encoder_configs_cpu_and_gpu(checkpoint):
    import json

    from triton_vlm.families import detect_family
    from triton_vlm.repository.configs import check_pipeline, model_configs
    from triton_vlm.repository.options import BuildOptions

    config = json.loads((checkpoint / "config.json").read_text())
    for device in ("cpu", "gpu"):
        options = BuildOptions(device=device, encoder_max_queue_delay_us=1234, encoder_cache_bytes=1 << 20,
                               encoder_instances=2, encoder_backend="tensorrt" if device == "gpu" else "", gpus="0")
        configs = model_configs(detect_family(checkpoint), config, options)
        check_pipeline(configs)
        front, batch = configs["vision_encoder"], configs["vision_encoder_batch"]
        assert front.max_batch_size == 0 and [list(t.dims) for t in front.input][1] == [-1, 3]
        assert batch.max_batch_size == options.encoder_max_batch_patches
        assert batch.dynamic_batching.max_queue_delay_microseconds == 1234
        assert [t.name for t in batch.input] == ["pixel_values", "patch_grid", "odd_share", "patch_temporal_id",
                                                "patch_image_size", "patch_padded_patches"]
        assert list(batch.input[1].dims) == [3] and all(t.optional for t in batch.input[2:])
        assert [t.name for t in front.input][-3:] == ["temporal_ids", "image_sizes", "padded_patches"]
        assert all(t.optional for t in front.input[-3:])
        assert front.parameters["packed_frames"].string_value == "false"  # Qwen2.5-VL's frames are independent
        assert batch.parameters["cache_bytes"].string_value == str(1 << 20)
        assert batch.instance_group[0].count == 2
        gpu = device == "gpu"
        assert ("engine_file" in batch.parameters) == gpu
        assert (batch.instance_group[0].kind == batch.instance_group[0].KIND_GPU) == gpu
