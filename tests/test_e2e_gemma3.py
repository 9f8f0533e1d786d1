"""Gemma 3 end to end behind a real tritonserver (the tiny demo checkpoint with its configs as
4.x wrote them: `tests/config_variants.py`'s "varied": a 9-token sliding window, 2 sliding layers
to 1 full, older rope spellings), checked against transformers in the same run.

`preprocess` equals `Gemma3Processor` (ids, pixel rows, grids; pan-and-scan asked for with
`mm_options {"do_pan_and_scan": true}`); `vision_encoder` equals `get_image_features`; the
ensemble's greedy `output_ids` equal `generate` for text, one image, two images and pan-and-scan
crops, over gRPC streaming and HTTP generate, alone and concurrently; a video and a non-boolean
`do_pan_and_scan` are INVALID_ARG naming them, and the server goes on serving.
"""
from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from tests.test_e2e import concurrently, grpc_tokens, http_tokens, infer_direct, media_values
from tests.test_preprocess_gemma3 import chat, image
from triton_vlm.families.gemma3.processor import BOI
from triton_vlm.families.llava.tower import patch_rows
from triton_vlm.media import samples

NEW_TOKENS = 8
PAN = {"do_pan_and_scan": True}
# (prompt, images, mm_options)
PROMPTS = {
    "image": (chat(BOI + "What is in the picture?"), [image(640, 480)], None),
    "images": (chat(f"{BOI} and {BOI} which is red?"), [image(200, 100, 1.0), image(90, 300, 2.0)], None),
    "text": (chat("Tell me about a red car on the road."), [], None),
    "pan-and-scan": (chat(f"Look: {BOI} what is it?"), [image(900, 300, 3.0)], PAN),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.test_e2e import family_server

    with family_server("gemma3", tmp_path_factory.mktemp("gemma3-e2e"), "varied") as served:
        yield served


def hf_inputs(oracle, prompt: str, images: list[bytes], mm_options: dict | None) -> dict:
    from PIL import Image

    kwargs = {"images": [Image.open(io.BytesIO(b)).convert("RGB") for b in images], **(mm_options or {})} \
        if images else {}
    return oracle.processor(text=[prompt], return_tensors="pt", **kwargs)


def test_preprocess_matches_gemma3_processor(served):
    server, oracle = served
    for prompt, images, options in PROMPTS.values():
        out = infer_direct(server, "preprocess", media_values(prompt, images, [], options),
                           ["input_ids", "pixel_values", "grid_thw", "mrope_position_ids"])
        inputs = hf_inputs(oracle, prompt, images, options)
        np.testing.assert_array_equal(out["input_ids"], inputs["input_ids"][0].numpy())
        if images:
            pixels = patch_rows(inputs["pixel_values"].numpy(), 14)
            np.testing.assert_array_equal(out["pixel_values"].reshape(pixels.shape), pixels)
            assert out["grid_thw"].reshape(-1, 3).tolist() == [[1, 8, 8]] * inputs["pixel_values"].shape[0]
        n = inputs["input_ids"].shape[1]
        np.testing.assert_array_equal(out["mrope_position_ids"], np.broadcast_to(np.arange(n), (3, n)))


def test_vision_encoder_matches_get_image_features(served):
    server, oracle = served
    prompt, images, options = PROMPTS["pan-and-scan"]
    inputs = hf_inputs(oracle, prompt, images, options)
    pixels = patch_rows(inputs["pixel_values"].numpy(), 14)
    grid = np.array([[1, 8, 8]] * inputs["pixel_values"].shape[0], np.int64)
    out = infer_direct(server, "vision_encoder", {"pixel_values": (pixels, "FP32"), "grid_thw": (grid, "INT64")},
                       ["embeddings"])["embeddings"]
    with torch.no_grad():
        ref = oracle.model.model.get_image_features(inputs["pixel_values"]).pooler_output
    ref = ref.reshape(-1, ref.shape[-1]).numpy()
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-4


@pytest.fixture(scope="module")
def expected_tokens(served) -> dict[str, list[int]]:
    _, oracle = served
    return {kind: oracle.generate(hf_inputs(oracle, prompt, images, options), NEW_TOKENS)
            for kind, (prompt, images, options) in PROMPTS.items()}


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_tokens_equal_hf_generate(served, expected_tokens, kind):
    server, _ = served
    prompt, images, options = PROMPTS[kind]
    assert grpc_tokens(server, prompt, images, [], NEW_TOKENS, mm_options=options) == expected_tokens[kind]
    assert http_tokens(server, prompt, images, [], NEW_TOKENS, mm_options=options) == expected_tokens[kind]


def test_concurrent_requests_each_get_their_own_answer(served, expected_tokens):
    server, _ = served

    def run(kind: str) -> list[int]:
        prompt, images, options = PROMPTS[kind]
        return grpc_tokens(server, prompt, images, [], NEW_TOKENS, mm_options=options)

    assert concurrently(run, PROMPTS) == expected_tokens


def test_refusals_name_the_input_and_the_server_keeps_serving(served, expected_tokens):
    from triton_vlm.clients.client import RequestError

    server, _ = served
    video = samples.video_bytes(seconds=1.0, fps=4, width=64, height=64)
    prompt, refusal = chat("What moves?"), r"^videos: this model \(gemma3\) takes no videos"
    with pytest.raises(RequestError, match=refusal):  # (a gRPC stream carries the message alone)
        grpc_tokens(server, prompt, [], [video], NEW_TOKENS)
    with pytest.raises(InferenceServerException) as direct:
        infer_direct(server, "preprocess", media_values(prompt, [], [video]), ["input_ids"])
    assert direct.value.status() == "StatusCode.INVALID_ARGUMENT" and re.match(refusal, direct.value.message())
    with pytest.raises(RequestError, match="mm_options: do_pan_and_scan must be a boolean"):
        grpc_tokens(server, *PROMPTS["image"][:2], [], NEW_TOKENS, mm_options={"do_pan_and_scan": "yes"})
    prompt, images, _ = PROMPTS["image"]
    assert grpc_tokens(server, prompt, images, [], NEW_TOKENS) == expected_tokens["image"]
