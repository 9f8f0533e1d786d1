"""InternVL's vision side (InternViT, pixel shuffle, LN-MLP projector) through the torch back end and
the ONNX Runtime export, against `InternVLModel.get_image_features` on the same checkpoints: the
tiny demo (InternViT-300M's switches: qkv biases, LayerNorm, mean pooling) and its InternVL3.5-style
variant (InternViT-6B's switches: no qkv bias, RMSNorm, q/k RMSNorm over the whole embedding, the
final LayerNorm; a Qwen3 decoder). Inputs come from the checkpoint's own processor (tiles and
thumbnails of images of several sizes, as patch rows). Error = max |ours - ref| / max |ref|: within
1e-5 for torch, 1e-4 for ONNX Runtime.
"""
from __future__ import annotations

import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.encoder_checks import rel_err
from tests.oracle import Oracle
from triton_vlm.errors import InvalidInput
from triton_vlm.families.internvl.demo import VIT_6B
from triton_vlm.families.internvl.tower import InternVLTower, vision_settings
from triton_vlm.families.llava.tower import patch_rows
from triton_vlm.media import samples

SIZES = [(640, 480), (56, 56), (60, 300)]
VARIANTS = {"vit-300m": {}, "vit-6b-qwen3": dict(text_model="qwen3", vision=VIT_6B)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    """(checkpoint, pixel rows, grid_thw, transformers' embeddings) for the tiles of three images."""
    from PIL import Image

    from triton_vlm.families.demo import write_demo_checkpoint

    checkpoint = write_demo_checkpoint("internvl", tmp_path_factory.mktemp("internvl"), "tiny",
                                       overrides=VARIANTS[request.param])
    oracle = Oracle(checkpoint)
    images = [Image.open(io.BytesIO(samples.image_bytes(w, h, seed=float(i)))).convert("RGB")
              for i, (w, h) in enumerate(SIZES)]
    inputs = oracle.processor.image_processor(images=images, crop_to_patches=True, return_tensors="pt")
    with torch.no_grad():
        ref = oracle.model.model.get_image_features(inputs["pixel_values"]).pooler_output
    ref = ref.reshape(-1, ref.shape[-1]).numpy()
    tiles = inputs["pixel_values"].numpy()
    side = tiles.shape[-1] // 14
    return checkpoint, patch_rows(tiles, 14), np.array([[1, side, side]] * len(tiles)), ref


@pytest.fixture(scope="module")
def onnx_path(case, tmp_path_factory):
    from triton_vlm.vision.runtime.export import export_onnx

    return export_onnx(case[0], tmp_path_factory.mktemp("internvl-onnx") / "encoder.onnx")


def test_rows_per_tile_are_the_pixel_shuffles(case):
    checkpoint, pixels, grid, ref = case
    settings = InternVLTower.read_vision_config(checkpoint)
    assert len(grid) > len(SIZES)  # tiles and thumbnails
    assert InternVLTower.embedding_rows(grid, settings).tolist() == [settings["side"] ** 2 // 4] * len(grid)
    assert ref.shape[0] == len(grid) * settings["side"] ** 2 // 4


def test_torch_back_end_matches_get_image_features(case):
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    checkpoint, pixels, grid, ref = case
    assert rel_err(TorchEncoder(checkpoint, "cpu", "float32").encode(pixels, grid), ref) <= 1e-5


@pytest.mark.parametrize("max_patches_per_run", [2048, 16 * 2], ids=["one-run", "runs-of-two-tiles"])
def test_onnx_matches_get_image_features(case, onnx_path, max_patches_per_run):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    _, pixels, grid, ref = case
    encoder = VisionEncoder(onnx_path, max_patches_per_run=max_patches_per_run)
    encoder.warmup()
    assert rel_err(encoder.encode(pixels, grid), ref) <= 1e-4


def test_batched_requests_through_both_back_ends(case, onnx_path):
    """Two requests in one batched execution (the server's `BatchedEncoder`) give each its own rows."""
    from triton_vlm.vision.batching import BatchedEncoder, EmbeddingCache
    from triton_vlm.vision.runtime.encoder import VisionEncoder
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    checkpoint, pixels, grid, ref = case
    per_tile, rows = pixels.shape[0] // len(grid), ref.shape[0] // len(grid)
    batch = [(pixels[:3 * per_tile], grid[:3], {}), (pixels[per_tile:], grid[1:], {})]
    for back_end in (VisionEncoder(onnx_path), TorchEncoder(checkpoint, "cpu", "float32")):
        (first, second), _ = BatchedEncoder(back_end, EmbeddingCache(1 << 24)).encode_many(batch)
        assert rel_err(first, ref[:3 * rows]) <= 1e-4 and rel_err(second, ref[rows:]) <= 1e-4


def test_a_grid_of_another_size_is_refused(case, onnx_path):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    _, pixels, grid, _ = case
    side = int(grid[0, 1])
    with pytest.raises(InvalidInput, match=f"grid_thw: InternVL's tower takes tiles of {side} x {side} patches"):
        VisionEncoder(onnx_path).encode(pixels[:side * (side - 2)], np.array([[1, side, side - 2]]))


@pytest.mark.parametrize("key, value", [("vision_feature_layer", -2), ("vision_feature_select_strategy", "full"),
                                        ("downsample_ratio", 0.25)])
def test_features_it_does_not_implement_are_refused_by_name(key, value):
    with pytest.raises(ValueError, match=f"InternVL: {key} .* is not supported"):
        vision_settings({"vision_config": {}, "text_config": {"hidden_size": 8}, key: value})


@pytest.mark.parametrize("key, value", [("norm_type", "batch_norm"), ("model_type", "siglip_vision_model")])
def test_an_unknown_tower_is_refused_by_name(key, value):
    with pytest.raises(ValueError, match=f"InternVL: vision_config.{key} '{value}' is not supported"):
        vision_settings({"vision_config": {key: value}, "text_config": {"hidden_size": 8}})


def test_float16_export_within_1e_2(case, tmp_path):
    from triton_vlm.vision.runtime.encoder import VisionEncoder
    from triton_vlm.vision.runtime.export import export_onnx

    checkpoint, pixels, grid, ref = case
    encoder = VisionEncoder(export_onnx(checkpoint, tmp_path / "float16.onnx", dtype="float16"))
    assert encoder.dtype == "float16"
    out = encoder.encode(pixels, grid)
    assert out.dtype == np.float32 and rel_err(out, ref) < 1e-2


def test_unfused_graph_runs_standard_ops_and_matches(case, onnx_path, tmp_path):
    from tests.encoder_checks import check_unfused_matches

    checkpoint, pixels, grid, ref = case
    settings = InternVLTower.read_vision_config(checkpoint)
    check_unfused_matches(onnx_path, InternVLTower, settings, {"tiles": (pixels, grid, ref)}, tmp_path)


def test_tensorrt_engines_are_built_from_the_export_of_their_precision(case, onnx_path, tmp_path):
    from tests.encoder_checks import check_engine_graphs

    check_engine_graphs(case[0], onnx_path, tmp_path)
