"""Qwen3-VL and Qwen3-VL-MoE end to end, each behind its own real tritonserver, checked against
transformers in the same run.

For each (a tiny demo checkpoint, its configs as `SERVED_AS` says: Qwen3-VL's exactly as
transformers' classes write them, the MoE's respelled, `tests/config_variants.py`): `preprocess`
equals the checkpoint's own processor (`input_ids` with each video frame's timestamp and span,
`grid_thw` and `pixel_values` rows in prompt order) and `get_rope_index`, for images of several
sizes, two images, a video and an image with a video; `vision_encoder` gives the model's
`get_image_features` / `get_video_features` rows, each followed by its DeepStack maps, and its cache
serves them again bit for bit; the ensemble's greedy `output_ids` equal `generate` over gRPC
streaming and HTTP generate, alone and with the other prompts in flight at the same time.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.encoder_checks import encode, rel_err
from tests.oracle import feature_rows
from tests.test_e2e import assert_served_tokens, family_server, grpc_tokens, infer_direct, media_values
from tests.test_encoder_serving import metric
from tests.test_preprocess_qwen3_vl import hf_in_prompt_order
from triton_vlm.families.qwen3_vl import QWEN3_VL
from triton_vlm.media import samples

FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
SERVED_AS = {"qwen3_vl": "bare", "qwen3_vl_moe": "varied"}
IMG, VID = QWEN3_VL.image_placeholder, QWEN3_VL.video_placeholder
IMAGE_A = samples.image_bytes(300, 200)
IMAGE_B = samples.image_bytes(120, 180, fmt="PNG", seed=1.0)
IMAGE_SMALL = samples.image_bytes(40, 30, seed=2.0)  # below min_pixels: scaled up
VIDEO = samples.video_bytes(seconds=2.5, fps=4, width=96, height=64)  # an odd number of sampled frames
NEW_TOKENS = 8


def chat(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = {
    "image": (chat(IMG + "What is in the picture?"), [IMAGE_A], []),
    "small image": (chat(IMG + "What is it?"), [IMAGE_SMALL], []),
    "two images": (chat(IMG + "and" + IMG + "which is larger?"), [IMAGE_A, IMAGE_B], []),
    "video": (chat(VID + "What moves?"), [], [VIDEO]),
    "image+video": (chat(IMG + "then" + VID + "compare them."), [IMAGE_B], [VIDEO]),
    "text": (chat("Tell me about a red car on the road."), [], []),
}


@pytest.fixture(scope="module", params=FAMILIES)
def qwen3(request, tmp_path_factory):
    """(family, running server, oracle) for one family's tiny checkpoint; the server is stopped after."""
    with family_server(request.param, tmp_path_factory.mktemp(request.param), SERVED_AS[request.param]) as served:
        yield (request.param, *served)


def hf_inputs(oracle, prompt, images, videos) -> dict:
    return oracle.inputs(prompt, images, videos, fps=None)  # the checkpoint's own sampling


@torch.no_grad()
def hf_rows(oracle, pixel_values, grid_thw, video: bool) -> np.ndarray:
    """The model's vision rows, each followed by its DeepStack maps."""
    features = (oracle.model.model.get_video_features if video else oracle.model.model.get_image_features)(
        pixel_values, grid_thw)
    return torch.cat(feature_rows(features)).numpy()


@pytest.mark.parametrize("kind", [k for k in PROMPTS if k != "text"])
def test_preprocess_matches_hf_processor(qwen3, kind):
    _, server, oracle = qwen3
    prompt, images, videos = PROMPTS[kind]
    inputs = hf_inputs(oracle, prompt, images, videos)
    out = infer_direct(server, "preprocess", media_values(prompt, images, videos),
                       ["input_ids", "pixel_values", "grid_thw", "mrope_position_ids", "mrope_position_delta"])
    np.testing.assert_array_equal(out["input_ids"], inputs["input_ids"][0].numpy())
    pixel_values, grid_thw = hf_in_prompt_order(prompt, inputs)
    np.testing.assert_array_equal(out["grid_thw"], grid_thw)
    assert out["pixel_values"].shape == pixel_values.shape
    assert np.abs(out["pixel_values"] - pixel_values).max() <= 1e-4
    positions, delta = oracle.rope_index(inputs)
    np.testing.assert_array_equal(out["mrope_position_ids"], positions)
    assert int(out["mrope_position_delta"][0]) == delta


@pytest.mark.parametrize("kind", ["image", "video"])
def test_vision_encoder_gives_hf_rows_and_maps(qwen3, kind):
    _, server, oracle = qwen3
    inputs = hf_inputs(oracle, *PROMPTS[kind])
    key, grid_key = ("pixel_values", "image_grid_thw") if kind == "image" else ("pixel_values_videos", "video_grid_thw")
    out = encode(server, inputs[key].numpy(), inputs[grid_key].numpy())
    reference = hf_rows(oracle, inputs[key], inputs[grid_key], kind == "video")
    assert out.shape == reference.shape and out.shape[1] == 3 * oracle.model.config.text_config.hidden_size
    assert rel_err(out, reference) <= 1e-4


def test_encoder_cache_serves_the_maps_again(qwen3):
    """An item encoded before is served from the cache: the same rows, DeepStack maps included."""
    _, server, oracle = qwen3
    inputs = hf_inputs(oracle, chat(IMG), [samples.image_bytes(250, 330, seed=42.0)], [])
    pixels, grid = inputs["pixel_values"].numpy(), inputs["image_grid_thw"].numpy()
    first = encode(server, pixels, grid)
    hits = metric(server, "triton_vlm_encoder_cache_hits", "vision_encoder_batch")
    second = encode(server, pixels, grid)
    assert metric(server, "triton_vlm_encoder_cache_hits", "vision_encoder_batch") - hits == 1
    assert second.tobytes() == first.tobytes()
    assert rel_err(second, hf_rows(oracle, inputs["pixel_values"], inputs["image_grid_thw"], False)) <= 1e-4


@pytest.fixture(scope="module")
def expected_tokens(qwen3) -> dict[str, list[int]]:
    _, _, oracle = qwen3
    return {kind: oracle.generate(hf_inputs(oracle, *PROMPTS[kind]), NEW_TOKENS) for kind in PROMPTS}


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_tokens_equal_hf_generate(qwen3, expected_tokens, kind):
    _, server, _ = qwen3
    assert_served_tokens(server, PROMPTS[kind], expected_tokens[kind], NEW_TOKENS)


def test_concurrent_requests_each_equal_alone(qwen3, expected_tokens):
    """Every prompt twice, all in flight at once (batched prefill and decode, the encoder batching
    items of several requests): each gets the tokens it gets alone, which are `generate`'s."""
    from concurrent.futures import ThreadPoolExecutor

    _, server, _ = qwen3
    kinds = list(PROMPTS) * 2
    with ThreadPoolExecutor(len(kinds)) as pool:
        results = list(pool.map(lambda kind: grpc_tokens(server, *PROMPTS[kind], NEW_TOKENS), kinds))
    assert results == [expected_tokens[kind] for kind in kinds]
