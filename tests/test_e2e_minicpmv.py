"""Issue #8 end to end: MiniCPM-V 4.6 behind a real tritonserver, checked against transformers in
the same run (tiny demo checkpoint, its configs "varied": tests/config_variants.py).

`preprocess` equals `MiniCPMV4_6Processor` (ids with the `<image_id>` / `<image>` / `<slice>`
layout, one `grid_thw` row per slice = its `target_sizes` row, pixel rows) for the issue's five
image sizes, a short video and a mix; `vision_encoder` equals `get_image_features` /
`get_video_features`; the ensemble's greedy `output_ids` equal `generate` over gRPC streaming and
HTTP generate, alone and concurrently.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.oracle import Oracle
from tests.test_e2e import assert_served_tokens, family_server, infer_direct, media_values, served_concurrently
from tests.test_preprocess_minicpmv import _media, chat, hf_in_prompt_order, image, model_positions, video
from triton_vlm.families.minicpmv.v4_6 import IMAGE_TOKEN as IMG
from triton_vlm.families.minicpmv.v4_6 import VIDEO_TOKEN as VID

NEW_TOKENS = 8
SIZES = [(448, 448), (640, 480), (1920, 1080), (4000, 1000), (200, 100)]
VIDEO = video(2.0, 4, 96, 64)
PROMPTS = {
    "image": (chat(IMG + "What is in the picture?"), [image(640, 480)], []),
    "video": (chat(VID + "What moves?"), [], [VIDEO]),
    "text": (chat("Tell me about a red car on the road."), [], []),
}


@pytest.fixture(scope="module")
def minicpmv(tmp_path_factory):
    """(running server, oracle) for the tiny checkpoint; the server is stopped after."""
    with family_server("minicpmv4_6", tmp_path_factory.mktemp("minicpmv4_6"), "varied") as served:
        yield served


def hf_inputs(oracle: Oracle, prompt: str, images, videos) -> dict:
    return oracle.processor(text=[prompt], return_tensors="pt", **_media(images, videos))


def check_preprocess(server, oracle: Oracle, prompt: str, images, videos) -> None:
    out = infer_direct(server, "preprocess", media_values(prompt, images, videos),
                       ["input_ids", "pixel_values", "grid_thw", "mrope_position_ids", "mrope_position_delta"])
    inputs = hf_inputs(oracle, prompt, images, videos)
    np.testing.assert_array_equal(out["input_ids"], inputs["input_ids"][0].numpy())
    pixel_values, grid_thw = hf_in_prompt_order(oracle, prompt, inputs, images, videos)
    np.testing.assert_array_equal(out["grid_thw"], grid_thw)
    assert out["pixel_values"].shape == pixel_values.shape
    assert np.abs(out["pixel_values"] - pixel_values).max() <= 1e-4
    np.testing.assert_array_equal(out["mrope_position_ids"], model_positions(oracle, inputs))
    assert int(out["mrope_position_delta"][0]) == 0


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_preprocess_image_matches_hf_processor(minicpmv, size):
    server, oracle = minicpmv
    check_preprocess(server, oracle, chat(IMG + "What is this?"), [image(*size)], [])


def test_preprocess_video_and_mix_match_hf_processor(minicpmv):
    server, oracle = minicpmv
    check_preprocess(server, oracle, *PROMPTS["video"])
    check_preprocess(server, oracle, chat(IMG + "and" + VID + "then" + IMG), [image(640, 480), image(200, 100)], [VIDEO])


@pytest.mark.parametrize("kind", ["image", "video"])
def test_vision_encoder_matches_hf_features(minicpmv, kind):
    server, oracle = minicpmv
    prompt, images, videos = (chat(IMG), [image(1920, 1080)], []) if kind == "image" else PROMPTS["video"]
    inputs = hf_inputs(oracle, prompt, images, videos)
    pixel_values, grid_thw = hf_in_prompt_order(oracle, prompt, inputs, images, videos)
    out = infer_direct(server, "vision_encoder",
                       {"pixel_values": (pixel_values, "FP32"), "grid_thw": (grid_thw.astype(np.int64), "INT64")},
                       ["embeddings"])["embeddings"]
    suffix = "" if kind == "image" else "_videos"
    features = getattr(oracle.model.model, f"get_{kind}_features")
    with torch.no_grad():
        reference = torch.cat(features(inputs[f"pixel_values{suffix}"], inputs[f"target_sizes{suffix}"]).pooler_output).numpy()
    assert out.shape == reference.shape
    assert np.abs(out - reference).max() / np.abs(reference).max() <= 1e-4


@pytest.fixture(scope="module")
def expected_tokens(minicpmv) -> dict[str, list[int]]:
    _, oracle = minicpmv
    return {kind: oracle.generate(hf_inputs(oracle, *PROMPTS[kind]), NEW_TOKENS) for kind in PROMPTS}


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_tokens_equal_hf_generate(minicpmv, expected_tokens, kind):
    server, _ = minicpmv
    assert_served_tokens(server, PROMPTS[kind], expected_tokens[kind], NEW_TOKENS)


def test_concurrent_requests_each_get_their_own_answer(minicpmv, expected_tokens):
    server, _ = minicpmv
    assert served_concurrently(server, PROMPTS, NEW_TOKENS) == expected_tokens
