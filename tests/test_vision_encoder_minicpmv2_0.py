"""MiniCPM-V 2.0's vision tower (`triton_vlm.families.minicpmv.tower_v2_0`) against the official
golden values (`tests/golden/minicpmv2_0/`, a copy of `shared/reference/minicpmv2_0/`: its README
says which official code and versions made each value): its settings read from the config and the
weights, the resampled position table (also against `F.interpolate` itself), the first slice's
`vpm` hidden state and every case's resampler rows, in torch, through the torch encoder and through
the ONNX export in ONNX Runtime (fused, and the unfused TensorRT form); slices of several sizes in
one call give each slice's rows alone.

Golden pixels: `pixel_codes/I` is slice I's plain CHW image (uint8 codes, pixel = (code / 255 -
0.5) / 0.5 in float32); `slice_rows` makes the tower's patch rows of it. Until the 2.0 family is
registered, the encoders find this tower through a stand-in family (`stand_in_family`)."""
from __future__ import annotations

import contextlib
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.encoder_checks import check_unfused_matches
from triton_vlm.families.minicpmv import tower_v2_0
from triton_vlm.families.minicpmv.tower_v2_0 import MiniCPMV2_0Tower as T

GOLDEN = Path(__file__).parent / "golden" / "minicpmv2_0"
ATOL = 1e-4  # the README's bound for a float32 run of another implementation
POS_ATOL = 1e-5
FAMILY = "minicpmv2_0"


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN / "golden.npz") as npz:
        return {key: npz[key] for key in npz.files}


def image_cases() -> list[str]:
    with np.load(GOLDEN / "golden.npz") as npz:
        return sorted({key.split("/")[0] for key in npz.files if key.endswith("/pixel_codes/0")})


CASES = image_cases()


def slice_rows(codes: np.ndarray) -> np.ndarray:
    """A slice's CHW codes [3, H, W] as the tower's rows [h * w, 3 * 14 * 14]: patches row-major,
    each in the Conv2d weight's (channel, dy, dx) order."""
    _, height, width = codes.shape
    assert height % 14 == 0 and width % 14 == 0
    h, w = height // 14, width // 14
    pixels = ((codes.astype(np.float32) / 255) - 0.5) / 0.5
    return pixels.reshape(3, h, 14, w, 14).transpose(1, 3, 0, 2, 4).reshape(h * w, -1)


def case_inputs(golden: dict[str, np.ndarray], case: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pixel rows, grid_thw, golden rows [slices * query_num, D]) of a case; each slice's (h, w)
    from its pixels, checked against the golden `tgt_sizes`."""
    sizes = golden[f"{case}/tgt_sizes"].reshape(-1, 2)
    slices = [golden[f"{case}/pixel_codes/{i}"] for i in range(len(sizes))]
    np.testing.assert_array_equal([[c.shape[1] // 14, c.shape[2] // 14] for c in slices], sizes)
    grid = np.concatenate([np.ones((len(sizes), 1), np.int64), sizes.astype(np.int64)], axis=1)
    embeds = golden[f"{case}/vision_embeds"]
    return np.concatenate([slice_rows(c) for c in slices]), grid, embeds.reshape(-1, embeds.shape[-1])


def close(out, expected, atol: float = ATOL) -> None:
    out, expected = np.asarray(out, np.float64), np.asarray(expected, np.float64)
    assert out.shape == expected.shape, (out.shape, expected.shape)
    assert np.abs(out - expected).max() <= atol, np.abs(out - expected).max()


@pytest.fixture(scope="module")
def settings() -> dict:
    return T.read_vision_config(GOLDEN)


@pytest.fixture(scope="module")
def tower() -> torch.nn.Module:
    return T.load_tower(GOLDEN).eval()


def run(tower, pixels: np.ndarray, grid: np.ndarray, settings: dict) -> np.ndarray:
    meta = T.encoder_metadata(grid, settings)
    with torch.inference_mode():
        return tower(torch.from_numpy(pixels), *(torch.from_numpy(meta[k]) for k in T.METADATA_INPUTS)).numpy()


@contextlib.contextmanager
def stand_in_family():
    """`detect_family` and `get_family` give a family named `FAMILY` whose tower is this one."""
    family = types.SimpleNamespace(name=FAMILY, tower_class=lambda: T)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("triton_vlm.vision.runtime.export.detect_family", lambda checkpoint: family)
        patch.setattr("triton_vlm.vision.runtime.torch_encoder.detect_family", lambda checkpoint: family)
        patch.setattr("triton_vlm.families.get_family", lambda name: family)
        yield


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory) -> Path:
    from triton_vlm.vision.runtime.export import export_onnx

    with stand_in_family():
        return export_onnx(GOLDEN, tmp_path_factory.mktemp("minicpmv2_0") / "vision.onnx")


@pytest.fixture(scope="module")
def encoder(onnx_path):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    with stand_in_family():
        return VisionEncoder(onnx_path, intra_op_threads=1)


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------

def test_settings_come_from_the_config_and_the_weights(settings):
    """The README's tiny tower: width 144, 2 kept blocks, 2 heads of 72, MLP 538, a 27 x 27 table;
    the resampler 256 wide with 16 queries (config.json's `hidden_size`, `query_num`)."""
    assert {k: settings[k] for k in ("hidden_size", "depth", "num_heads", "head_dim", "intermediate_size",
                                     "pos_embed_size", "out_hidden_size", "query_num", "patch_dim",
                                     "spatial_merge_size")} == dict(
        hidden_size=144, depth=2, num_heads=2, head_dim=72, intermediate_size=538, pos_embed_size=27,
        out_hidden_size=256, query_num=16, patch_dim=588, spatial_merge_size=1)
    # the config alone sizes what the encoder front counts with
    config = {"hidden_size": 256, "query_num": 16, "vision_encoder": tower_v2_0.VISION_ENCODER}
    assert T.checkpoint_settings(config)["query_num"] == 16
    assert T.embedding_rows(np.array([[1, 18, 55], [1, 32, 32]]), settings).tolist() == [16, 16]
    with pytest.raises(ValueError, match="vision_encoder"):
        T.vision_settings({**config, "vision_encoder": "vit_large_patch14_clip_224"})


def test_the_real_checkpoints_sizes_from_its_weights_shapes():
    """The so400m of the official checkpoint, 26 blocks kept: 16 heads of 72, MLP 4304."""
    shapes = {"vpm.pos_embed": (1, 729, 1152), "vpm.blocks.0.mlp.fc1.weight": (4304, 1152),
              **{f"vpm.blocks.{i}.norm1.weight": (1152,) for i in range(26)}}
    out = tower_v2_0.sized_settings(T.vision_settings({"hidden_size": 2304, "query_num": 64}), shapes)
    assert (out["depth"], out["num_heads"], out["intermediate_size"], out["pos_embed_size"]) == (26, 16, 4304, 27)
    with pytest.raises(ValueError, match="not 0..N-1"):
        tower_v2_0.sized_settings(out, {k: v for k, v in shapes.items() if k != "vpm.blocks.3.norm1.weight"})


def test_state_dict_is_the_checkpoints_vision_weights(tower):
    from safetensors import safe_open

    with safe_open(str(GOLDEN / "model.safetensors"), framework="pt") as f:
        names = {k for k in f.keys() if k.startswith(("vpm.", "resampler."))}
    assert set(tower.state_dict()) == names  # load_tower loads them strictly


# ---------------------------------------------------------------------------------------------
# The position table, resampled per slice
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [(1, 1), (5, 64), (18, 55), (26, 39), (27, 27), (27, 30), (37, 28), (40, 40)])
def test_position_table_is_f_interpolates_antialiased_bicubic(tower, settings, size):
    """The per-axis weights' outer product times the table is timm's `resample_abs_pos_embed`
    (`F.interpolate`, bicubic, antialias) of the golden table, smaller and larger than 27, non-square."""
    h, w = size
    table = tower.vpm.pos_embed.detach()
    side = settings["pos_embed_size"]
    grid = table.reshape(1, side, side, -1).permute(0, 3, 1, 2)
    ref = torch.nn.functional.interpolate(grid, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
    meta = T.encoder_metadata(np.array([[1, h, w]]), settings)
    with torch.inference_mode():
        ours = tower.positions(torch.from_numpy(meta["row_weights"]), torch.from_numpy(meta["col_weights"]))
    close(ours, ref[0].permute(1, 2, 0).reshape(h * w, -1), POS_ATOL)
    if (h, w) == (27, 27):  # timm leaves the table as it is: the weights are exactly the identity
        np.testing.assert_array_equal(tower_v2_0.axis_weights(27, 27), np.eye(27, dtype=np.float32))
        torch.testing.assert_close(ours, table[0], rtol=0, atol=0)


def test_position_table_of_the_golden_slice(tower, settings, golden):
    case = "c_image_1500x500"
    h, w = golden[f"{case}/tgt_sizes"][0]
    meta = T.encoder_metadata(np.array([[1, h, w]]), settings)
    with torch.inference_mode():
        ours = tower.positions(torch.from_numpy(meta["row_weights"]), torch.from_numpy(meta["col_weights"]))
    close(ours, golden[f"{case}/vision_pos_embed/0"], POS_ATOL)


# ---------------------------------------------------------------------------------------------
# The torch tower
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_torch_tower_gives_the_official_rows(tower, settings, golden, case):
    pixels, grid, expected = case_inputs(golden, case)
    close(run(tower, pixels, grid, settings), expected)
    if f"{case}/vpm_hidden/0" in golden:
        first = grid[:1]
        meta = T.encoder_metadata(first, settings)
        with torch.inference_mode():
            hidden = tower.hidden(torch.from_numpy(pixels[:int(first.prod())]),
                                  *(torch.from_numpy(meta[k]) for k in T.METADATA_INPUTS[:-1]))
        close(hidden, golden[f"{case}/vpm_hidden/0"])


def test_slices_of_several_sizes_in_one_call_are_each_alone(tower, settings, golden):
    """Attention stays inside each slice: every case's slices (five sizes) in one call, padded to
    the largest, give the rows of each slice run alone."""
    inputs = [case_inputs(golden, case) for case in CASES]
    pixels, grid = np.concatenate([p for p, _, _ in inputs]), np.concatenate([g for _, g, _ in inputs])
    assert len({tuple(row) for row in grid.tolist()}) >= 5
    together = run(tower, pixels, grid, settings)
    starts = np.concatenate([[0], np.cumsum(grid.prod(axis=1))])
    q = settings["query_num"]
    for i, row in enumerate(grid):
        alone = run(tower, pixels[starts[i]:starts[i + 1]], row[None], settings)
        close(together[i * q:(i + 1) * q], alone, 1e-5)
    close(together, np.concatenate([e for _, _, e in inputs]))


def test_metadata_refuses_packed_frames(settings):
    with pytest.raises(ValueError, match="single slices"):
        T.encoder_metadata(np.array([[2, 4, 4]]), settings)


def test_the_torch_encoder_gives_the_official_rows(golden):
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    with stand_in_family():
        torch_encoder = TorchEncoder(GOLDEN, max_patches_per_run=1024)
        for case in CASES:
            pixels, grid, expected = case_inputs(golden, case)
            close(torch_encoder.encode(pixels, grid), expected)


# ---------------------------------------------------------------------------------------------
# The ONNX export in ONNX Runtime
# ---------------------------------------------------------------------------------------------

def test_onnx_graph(encoder, settings):
    assert [i.name for i in encoder.session.get_inputs()] == list(T.INPUT_NAMES)
    assert encoder.family == FAMILY and encoder.settings == settings


@pytest.mark.parametrize("case", CASES)
def test_onnx_gives_the_official_rows(encoder, golden, case):
    pixels, grid, expected = case_inputs(golden, case)
    out = encoder.encode(pixels, grid)
    assert out.dtype == np.float32
    close(out, expected)


def test_onnx_one_run_of_slices_of_several_sizes(encoder, golden):
    """Every case's slices in one session run (padded to the largest slice)."""
    inputs = [case_inputs(golden, case) for case in CASES]
    pixels, grid = np.concatenate([p for p, _, _ in inputs]), np.concatenate([g for _, g, _ in inputs])
    close(encoder._run(pixels, grid, {}), np.concatenate([e for _, _, e in inputs]))


def test_half_precision_towers_stay_close(golden, settings, tmp_path):
    """The float16 export in ONNX Runtime and the bfloat16 torch tower: within 1e-2 of the largest
    golden row value (the position weights, residual stream and norms stay float32)."""
    from tests.encoder_checks import rel_err
    from triton_vlm.vision.runtime.encoder import VisionEncoder
    from triton_vlm.vision.runtime.export import export_onnx

    with stand_in_family():
        half = VisionEncoder(export_onnx(GOLDEN, tmp_path / "float16.onnx", dtype="float16"), intra_op_threads=1)
    bf16 = T.load_tower(GOLDEN, torch.bfloat16)
    for case in CASES:
        pixels, grid, expected = case_inputs(golden, case)
        assert rel_err(half.encode(pixels, grid), expected) < 1e-2, case
        assert rel_err(run(bf16, pixels, grid, settings), expected) < 1e-2, case


def test_unfused_graph_runs_standard_ops_and_matches(onnx_path, settings, golden, tmp_path):
    cases = {case: case_inputs(golden, case) for case in ("a_image_480x640", "c_image_1500x500")}
    check_unfused_matches(onnx_path, T, settings, cases, tmp_path)


def test_tensorrt_profile_covers_the_metadata(settings):
    shapes = T.profile_shapes(settings, (1, 1024, 4096))
    assert set(shapes) == set(T.INPUT_NAMES)
    for grid in ([[1, 18, 55]], [[1, 32, 32]] * 4, [[1, 1, 1]], [[1, 64, 64]]):
        meta = {"pixel_values": np.zeros((int(np.prod(grid, axis=1).sum()), settings["patch_dim"])),
                **T.encoder_metadata(np.array(grid), settings)}
        for name, (lo, _, hi) in shapes.items():
            assert all(a <= n <= b for a, n, b in zip(lo, meta[name].shape, hi)), (name, grid)
