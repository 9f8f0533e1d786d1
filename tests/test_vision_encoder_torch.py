"""The `torch` encoder back end (triton_vlm.vision.torch_encoder) against the ONNX Runtime one, on
the CPU in float32, for every family's tower, through the batched encoder the server runs
(`BatchedEncoder`, two requests of mixed sizes in one call)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.encoder_checks import rel_err
from triton_vlm.vision import get_tower

FAMILIES = ("qwen2_5_vl", "glm4v", "glm_ocr", "glm4v_moe", "minicpmv4_6")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    from triton_vlm.checkpoint import write_demo_checkpoint

    return write_demo_checkpoint(request.param, tmp_path_factory.mktemp(request.param), "tiny")


def test_torch_back_end_equals_onnx(checkpoint, tmp_path):
    from triton_vlm.families import detect_family
    from triton_vlm.vision.batching import BatchedEncoder, EmbeddingCache
    from triton_vlm.vision.encoder import VisionEncoder
    from triton_vlm.vision.export import export_onnx
    from triton_vlm.vision.torch_encoder import TorchEncoder

    tower = get_tower(detect_family(checkpoint).name)
    settings = tower.read_vision_config(checkpoint)
    # padded groups (partial windows, frames of several sizes) and a video in one batch
    grids = (tower.EXAMPLE_GRID, ((1, 12, 20), (1, 16, 24)))
    batch = []
    for seed, grid in enumerate(grids):
        pixels, _ = tower.example_inputs(settings, grid)
        batch.append((np.random.default_rng(seed).standard_normal(pixels.shape).astype(np.float32),
                      np.array(grid, dtype=np.int64)))
    onnx = BatchedEncoder(VisionEncoder(export_onnx(checkpoint, tmp_path / "encoder.onnx")), EmbeddingCache(0))
    torch_ = BatchedEncoder(TorchEncoder(checkpoint, "cpu", "float32"), EmbeddingCache(0))
    for ours, ref in zip(torch_.encode_many(batch)[0], onnx.encode_many(batch)[0]):
        assert rel_err(ours, ref) < 1e-4
