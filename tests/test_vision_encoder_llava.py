"""Issue #28: LLaVA's vision side (CLIP or SigLIP tower, `vision_feature_layer`, select strategy,
`LlavaMultiModalProjector`) through the torch back end and the ONNX Runtime export, against
`LlavaForConditionalGeneration.get_image_features` on the same checkpoints (`VARIANTS` of
`tests/test_preprocess_llava.py`, 1-D parameters perturbed), inputs from the checkpoint's own
processor (`patch_rows` of its [B, 3, H, W]). Error = max |ours - ref| / max |ref|: within 1e-5
for torch, 1e-4 for ONNX Runtime.
"""
from __future__ import annotations

import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.encoder_checks import check_batched_whole_views, rel_err
from tests.oracle import Oracle
from tests.test_preprocess_llava import VARIANTS, hf_rows, llava_checkpoints  # noqa: F401 (fixture)
from triton_vlm.errors import InvalidInput
from triton_vlm.families.llava.tower import LlavaTower
from triton_vlm.media import samples

SIZES = [(640, 480), (200, 100), (112, 112), (60, 300), (1920, 1080)]


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, llava_checkpoints, tmp_path_factory):
    """(checkpoint, pixel rows, grid_thw, transformers' embeddings) for five images."""
    from PIL import Image

    oracle = Oracle(llava_checkpoints[request.param])
    images = [Image.open(io.BytesIO(samples.image_bytes(w, h, seed=float(i)))).convert("RGB")
              for i, (w, h) in enumerate(SIZES)]
    inputs = oracle.processor.image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        ref = torch.cat(list(oracle.model.model.get_image_features(inputs["pixel_values"]).pooler_output)).numpy()
    pixels, grid = hf_rows(oracle, inputs)
    return oracle.checkpoint, pixels, grid, ref


@pytest.fixture(scope="module")
def onnx_path(case, tmp_path_factory):
    from triton_vlm.vision.runtime.export import export_onnx

    return export_onnx(case[0], tmp_path_factory.mktemp("llava-onnx") / "encoder.onnx")


def test_settings_read_from_the_checkpoint(case):
    """The feature layers as transformers indexes `hidden_states` (negative: from the end), the rows
    per image (class token kept or first token dropped), only the layers used built."""
    checkpoint = case[0]
    config = Oracle(checkpoint).model.config
    settings = LlavaTower.read_vision_config(checkpoint)
    layers = config.vision_feature_layer
    layers = layers if isinstance(layers, list) else [layers]
    depth = config.vision_config.num_hidden_layers
    assert settings["feature_layers"] == [i % (depth + 1) for i in layers]
    side = config.vision_config.image_size // config.vision_config.patch_size
    rows = LlavaTower.embedding_rows(np.array([[1, side, side]]), settings)
    class_token = config.vision_config.model_type == "clip_vision_model"
    assert rows.tolist() == [side * side + class_token - (config.vision_feature_select_strategy == "default")]
    tower = LlavaTower.load_tower(checkpoint)
    assert len(tower.vision_tower.encoder.layers) == max(settings["feature_layers"])


def test_torch_back_end_matches_get_image_features(case):
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    checkpoint, pixels, grid, ref = case
    encoder = TorchEncoder(checkpoint, "cpu", "float32")
    assert rel_err(encoder.encode(pixels, grid), ref) <= 1e-5


@pytest.mark.parametrize("max_patches_per_run", [2048, 64 * 2], ids=["one-run", "runs-of-two-images"])
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

    _, pixels, grid, _ = case
    side = int(grid[0, 1])
    with pytest.raises(InvalidInput, match=f"grid_thw: LLaVA's tower takes images of {side} x {side} patches"):
        VisionEncoder(onnx_path).encode(pixels[:side * (side - 1)], np.array([[1, side, side - 1]]))


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
    settings = LlavaTower.read_vision_config(checkpoint)
    check_unfused_matches(onnx_path, LlavaTower, settings, {"images": (pixels, grid, ref)}, tmp_path)


def test_tensorrt_engines_are_built_from_the_export_of_their_precision(case, onnx_path, tmp_path):
    from tests.encoder_checks import check_engine_graphs

    check_engine_graphs(case[0], onnx_path, tmp_path)


def test_tensorrt_profile_covers_the_inputs(case):
    """Whole images only: the profile's bounds are multiples of S^2, at least one image."""
    from tests.encoder_checks import check_profile_covers
    from triton_vlm.vision.runtime.tensorrt_engine import EngineProfile

    settings = LlavaTower.read_vision_config(case[0])
    side = settings["side"]
    check_profile_covers("llava", LlavaTower, settings, EngineProfile(16, 1024, 4096),
                         ([[1, side, side]], [[1, side, side]] * 8, [[16, side, side]]))
    assert LlavaTower.warmup_grid(settings, 3 * side * side - 1).tolist() == [[3, side, side]]


def test_build_configs_batch_whole_images_and_tell_the_front_the_rows(case):
    """`vision_encoder_batch` gets every tower's `max_batch_size` (`--encoder-max-batch-patches` patch
    rows: 65536 by default, 1024 images of 8 x 8 patches here), and the `vision_encoder` front counts
    the rows an image gives as the tower does (one per patch and `extra_rows`: a class token kept,
    or the first token dropped), without the tower."""
    import json

    from triton_vlm.contract.params import EncoderOptions
    from triton_vlm.contract.tensors import ENCODER_BATCH_MODEL
    from triton_vlm.families import detect_family
    from triton_vlm.repository.configs import model_configs
    from triton_vlm.repository.options import BuildOptions
    from triton_vlm.vision.front import EncoderFront

    checkpoint = case[0]
    configs = model_configs(detect_family(checkpoint), json.loads((checkpoint / "config.json").read_text()),
                            BuildOptions())
    assert configs[ENCODER_BATCH_MODEL].max_batch_size == BuildOptions().encoder_max_batch_patches == 65536
    params = {k: v.string_value for k, v in configs["vision_encoder"].parameters.items()}
    front = EncoderFront(EncoderOptions.from_params(params), send=None)
    settings = LlavaTower.read_vision_config(checkpoint)
    grid = np.array([[1, settings["side"], settings["side"]]] * 3)
    assert front.options.spatial_merge_size == 1
    assert front.embedding_rows(grid, {}).tolist() == LlavaTower.embedding_rows(grid, settings).tolist()
    assert front.embedding_rows(grid, {}).tolist() == [settings["side"] ** 2 + settings["extra_rows"]] * 3
