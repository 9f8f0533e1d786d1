"""Issue #29 end to end: MiniCPM-V 4.7 behind a real tritonserver, checked against transformers in
the same run (tiny demo checkpoint, its configs "bare" as transformers' classes write them: no
`mrope_interleaved`, no `mrope_section`; tests/config_variants.py).

`preprocess` equals `MiniCPMV4_7Processor` (ids, one `grid_thw` row per crop, pixel rows) and
`get_rope_index` (canvas positions and delta); the ensemble's greedy `output_ids` equal `generate`
for an image, several images, a video and images mixed with a video, over gRPC streaming and HTTP
generate, alone and concurrently.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.test_e2e import assert_served_tokens, family_server, infer_direct, media_values, served_concurrently
from tests.test_preprocess_minicpmv import _media, chat, hf_in_prompt_order, image, video
from tests.test_preprocess_minicpmv4_7 import rope_index
from triton_vlm.families.minicpmv.v4_6 import IMAGE_TOKEN as IMG
from triton_vlm.families.minicpmv.v4_6 import VIDEO_TOKEN as VID

NEW_TOKENS = 8
VIDEO = video(2.0, 4, 96, 64)
PROMPTS = {
    "image": (chat(IMG + "What is in the picture?"), [image(1920, 1080)], []),
    "several images": (chat(IMG + "and" + IMG + "?"), [image(640, 480), image(200, 100)], []),
    "video": (chat(VID + "What moves?"), [], [VIDEO]),
    "mix": (chat(IMG + "and" + VID + "then" + IMG), [image(640, 480), image(448, 448)], [VIDEO]),
    "text": (chat("Tell me about a red car on the road."), [], []),
}


@pytest.fixture(scope="module")
def minicpmv(tmp_path_factory):
    """(running server, oracle) for the tiny checkpoint; the server is stopped after."""
    with family_server("minicpmv4_7", tmp_path_factory.mktemp("minicpmv4_7"), "bare") as served:
        yield served


def hf_inputs(oracle, prompt: str, images, videos) -> dict:
    return oracle.processor(text=[prompt], return_tensors="pt", **_media(images, videos))


@pytest.mark.parametrize("name", ["image", "several images", "video", "mix"])
def test_preprocess_matches_hf_processor_and_rope_index(minicpmv, name):
    server, oracle = minicpmv
    prompt, images, videos = PROMPTS[name]
    out = infer_direct(server, "preprocess", media_values(prompt, images, videos),
                       ["input_ids", "pixel_values", "grid_thw", "mrope_position_ids", "mrope_position_delta"])
    inputs = hf_inputs(oracle, prompt, images, videos)
    np.testing.assert_array_equal(out["input_ids"], inputs["input_ids"][0].numpy())
    pixel_values, grid_thw = hf_in_prompt_order(oracle, prompt, inputs, images, videos)
    np.testing.assert_array_equal(out["grid_thw"], grid_thw)
    assert out["pixel_values"].shape == pixel_values.shape
    assert np.abs(out["pixel_values"] - pixel_values).max() <= 1e-4
    positions, delta = rope_index(oracle, inputs)
    np.testing.assert_array_equal(out["mrope_position_ids"], positions)
    assert int(out["mrope_position_delta"][0]) == delta


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
