"""Gemma 3's vision side (SigLIP's `last_hidden_state`, the average pool to `mm_tokens_per_image`,
the (1 + w) RMSNorm and the projection) through the torch back end and the ONNX Runtime export,
against `Gemma3Model.get_image_features` on the tiny demo checkpoint (every 1-D parameter and the
projection moved off their initial values), inputs from the checkpoint's own processor (images
and pan-and-scan crops: `patch_rows` of its [B, 3, H, W]). Error = max |ours - ref| / max |ref|:
within 1e-5 for torch, 1e-4 for ONNX Runtime.
"""
from __future__ import annotations

import io
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.encoder_checks import check_batched_whole_views, rel_err
from tests.oracle import Oracle
from triton_vlm.errors import InvalidInput
from triton_vlm.families.gemma3.tower import Gemma3Tower
from triton_vlm.families.llava.tower import patch_rows
from triton_vlm.media import samples

SIZES = [(640, 480), (200, 100), (900, 300), (60, 300)]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(checkpoint, pixel rows, grid_thw, transformers' embeddings) for four images with their crops."""
    from PIL import Image

    from triton_vlm.families.demo import write_demo_checkpoint

    oracle = Oracle(write_demo_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"), "tiny"))
    images = [Image.open(io.BytesIO(samples.image_bytes(w, h, seed=float(i)))).convert("RGB")
              for i, (w, h) in enumerate(SIZES)]
    pixels = oracle.processor(text=["<start_of_image>" * len(images)], images=images, do_pan_and_scan=True,
                              return_tensors="pt")["pixel_values"]
    assert pixels.shape[0] > len(SIZES)  # crops among the views
    with torch.no_grad():
        ref = oracle.model.model.get_image_features(pixels).pooler_output
    ref = ref.reshape(-1, ref.shape[-1]).numpy()
    side = pixels.shape[-1] // 14
    return oracle.checkpoint, patch_rows(pixels.numpy(), 14), np.array([[1, side, side]] * pixels.shape[0]), ref


@pytest.fixture(scope="module")
def onnx_path(case, tmp_path_factory):
    from triton_vlm.vision.runtime.export import export_onnx

    return export_onnx(case[0], tmp_path_factory.mktemp("gemma3-onnx") / "encoder.onnx")


def test_settings_and_rows(case):
    settings = Gemma3Tower.read_vision_config(case[0])
    assert (settings["side"], settings["pool"], settings["mm_tokens_per_image"]) == (8, 2, 16)
    assert Gemma3Tower.embedding_rows(np.array([[1, 8, 8], [3, 8, 8]]), settings).tolist() == [16, 48]


def test_torch_back_end_matches_get_image_features(case):
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    checkpoint, pixels, grid, ref = case
    assert rel_err(TorchEncoder(checkpoint, "cpu", "float32").encode(pixels, grid), ref) <= 1e-5


@pytest.mark.parametrize("max_patches_per_run", [2048, 64 * 2], ids=["one-run", "runs-of-two-views"])
def test_onnx_matches_get_image_features(case, onnx_path, max_patches_per_run):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    _, pixels, grid, ref = case
    encoder = VisionEncoder(onnx_path, max_patches_per_run=max_patches_per_run)
    encoder.warmup()
    assert rel_err(encoder.encode(pixels, grid), ref) <= 1e-4


def test_batched_requests_through_both_back_ends(case, onnx_path):
    check_batched_whole_views(case[0], onnx_path, *case[1:])


def test_a_grid_of_another_size_is_refused(case, onnx_path):
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    _, pixels, _, _ = case
    with pytest.raises(InvalidInput, match="grid_thw: LLaVA's tower takes images of 8 x 8 patches"):
        VisionEncoder(onnx_path).encode(pixels[:8 * 7], np.array([[1, 8, 7]]))


def test_the_front_counts_the_rows_as_the_tower(case):
    from triton_vlm.contract.params import EncoderOptions
    from triton_vlm.families import detect_family
    from triton_vlm.repository.configs import model_configs
    from triton_vlm.repository.options import BuildOptions
    from triton_vlm.vision.front import EncoderFront

    checkpoint = case[0]
    configs = model_configs(detect_family(checkpoint), json.loads((checkpoint / "config.json").read_text()),
                            BuildOptions())
    params = {k: v.string_value for k, v in configs["vision_encoder"].parameters.items()}
    front = EncoderFront(EncoderOptions.from_params(params), send=None)
    grid = np.array([[1, 8, 8]] * 3)
    assert front.embedding_rows(grid, {}).tolist() == [16] * 3
