"""Issue #29 end to end: MiniCPM-OCR behind a real tritonserver, checked against transformers in
the same run (tiny demo checkpoint: "adaptive" small-image sizes, "4x" tokens, tied embeddings; its
configs "varied": tests/config_variants.py).

`preprocess` equals `MiniCPMOcrProcessor` (ids, one `grid_thw` row per slice, adaptive slices of
different sizes among them, pixel rows); `vision_encoder` equals `get_image_features`; the
ensemble's greedy `output_ids` equal `generate` for a document, several images, a video and a mix,
over gRPC streaming and HTTP generate, alone and concurrently; an image it cannot read is
INVALID_ARG and the server goes on serving.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from tests.test_e2e import (assert_served_tokens, family_server, grpc_tokens, infer_direct, media_values,
                            served_concurrently)
from tests.test_preprocess_minicpm_ocr import DOCUMENTS, document
from tests.test_preprocess_minicpmv import _media, chat, hf_in_prompt_order, video
from triton_vlm.families.minicpmv.v4_6 import IMAGE_TOKEN as IMG
from triton_vlm.families.minicpmv.v4_6 import VIDEO_TOKEN as VID

NEW_TOKENS = 8
VIDEO = video(2.0, 4, 96, 64)
PROMPTS = {
    "document": (chat(IMG + "Read the page."), [DOCUMENTS["half printed"]], []),
    "several images": (chat(IMG + "and" + IMG + "?"), [DOCUMENTS["printed corner"], DOCUMENTS["photo"]], []),
    "video": (chat(VID + "What moves?"), [], [VIDEO]),
    "mix": (chat(IMG + "and" + VID + "then" + IMG), [DOCUMENTS["wide strip"], DOCUMENTS["tiny photo"]], [VIDEO]),
}


@pytest.fixture(scope="module")
def ocr(tmp_path_factory):
    """(running server, oracle) for the tiny checkpoint; the server is stopped after."""
    with family_server("minicpm_ocr", tmp_path_factory.mktemp("minicpm_ocr"), "varied") as served:
        yield served


def hf_inputs(oracle, prompt: str, images, videos) -> dict:
    return oracle.processor(text=[prompt], return_tensors="pt", **_media(images, videos))


@pytest.mark.parametrize("name", list(PROMPTS))
def test_preprocess_matches_hf_processor(ocr, name):
    server, oracle = ocr
    prompt, images, videos = PROMPTS[name]
    out = infer_direct(server, "preprocess", media_values(prompt, images, videos),
                       ["input_ids", "pixel_values", "grid_thw", "mrope_position_delta"])
    inputs = hf_inputs(oracle, prompt, images, videos)
    np.testing.assert_array_equal(out["input_ids"], inputs["input_ids"][0].numpy())
    pixel_values, grid_thw = hf_in_prompt_order(oracle, prompt, inputs, images, videos)
    np.testing.assert_array_equal(out["grid_thw"], grid_thw)
    assert np.abs(out["pixel_values"] - pixel_values).max() <= 1e-4
    assert int(out["mrope_position_delta"][0]) == 0


def test_vision_encoder_matches_hf_features(ocr):
    server, oracle = ocr
    prompt, images, videos = PROMPTS["several images"]
    inputs = hf_inputs(oracle, prompt, images, videos)
    pixel_values, grid_thw = hf_in_prompt_order(oracle, prompt, inputs, images, videos)
    assert len({tuple(g) for g in grid_thw.tolist()}) > 1  # adaptive slices of their own sizes
    out = infer_direct(server, "vision_encoder",
                       {"pixel_values": (pixel_values, "FP32"), "grid_thw": (grid_thw.astype(np.int64), "INT64")},
                       ["embeddings"])["embeddings"]
    with torch.no_grad():
        reference = torch.cat(oracle.model.model.get_image_features(inputs["pixel_values"],
                                                                    inputs["target_sizes"]).pooler_output).numpy()
    assert out.shape == reference.shape
    assert np.abs(out - reference).max() / np.abs(reference).max() <= 1e-4


@pytest.fixture(scope="module")
def expected_tokens(ocr) -> dict[str, list[int]]:
    _, oracle = ocr
    return {kind: oracle.generate(hf_inputs(oracle, *PROMPTS[kind]), NEW_TOKENS) for kind in PROMPTS}


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_tokens_equal_hf_generate(ocr, expected_tokens, kind):
    server, _ = ocr
    assert_served_tokens(server, PROMPTS[kind], expected_tokens[kind], NEW_TOKENS)


def test_concurrent_requests_each_get_their_own_answer(ocr, expected_tokens):
    server, _ = ocr
    assert served_concurrently(server, PROMPTS, NEW_TOKENS) == expected_tokens


def test_an_image_it_cannot_read_is_invalid_arg_and_the_server_keeps_serving(ocr, expected_tokens):
    server, _ = ocr
    prompt = chat(IMG + "Read the page.")
    with pytest.raises(InferenceServerException) as direct:
        infer_direct(server, "preprocess", media_values(prompt, [document(4020, 18)], []), ["input_ids"])
    assert direct.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "images[0]: aspect ratio" in direct.value.message()
    assert grpc_tokens(server, *PROMPTS["document"], NEW_TOKENS) == expected_tokens["document"]
