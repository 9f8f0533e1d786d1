"""Qwen3.5 end to end behind a real tritonserver, and Qwen3.5-MoE through the same stages in this
process, both checked against transformers in the same run.

Qwen3.5 (a tiny demo checkpoint, its configs "varied": `tests/config_variants.py`): `preprocess`
equals the checkpoint's own processor (Qwen3-VL's: `input_ids` with each video frame's timestamp and
span, `grid_thw` and `pixel_values` rows in prompt order) and `get_rope_index`, for images of two
sizes, two images, a video and an image with a video; `vision_encoder` gives the model's
`get_image_features` / `get_video_features` rows (no DeepStack maps: the rows are the merger's
output alone); the ensemble's greedy `output_ids` equal `generate` over gRPC streaming and HTTP
generate, alone and with the other prompts in flight at the same time. Qwen3.5-MoE (configs
"bare", as transformers writes them): preprocess, the torch encoder and the engine give
transformers' ids, positions, rows, greedy tokens and logits on the same prompts.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.encoder_checks import encode, rel_err
from tests.oracle import Oracle, feature_rows
from tests.test_e2e import assert_served_tokens, family_server, infer_direct, media_values, served_concurrently
from tests.test_preprocess_qwen3_vl import hf_in_prompt_order
from triton_vlm.families.qwen3_vl import QWEN3_5
from triton_vlm.media import samples

IMG, VID = QWEN3_5.image_placeholder, QWEN3_5.video_placeholder
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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(running server, oracle) for Qwen3.5's tiny checkpoint; the server is stopped after."""
    with family_server("qwen3_5", tmp_path_factory.mktemp("qwen3_5"), "varied") as served:
        yield served


def hf_inputs(oracle, prompt, images, videos) -> dict:
    return oracle.inputs(prompt, images, videos, fps=None)  # the checkpoint's own sampling


@torch.no_grad()
def hf_rows(oracle, pixel_values, grid_thw, video: bool) -> np.ndarray:
    features = (oracle.model.model.get_video_features if video else oracle.model.model.get_image_features)(
        pixel_values, grid_thw)
    assert getattr(features, "deepstack_features", None) is None
    return torch.cat(feature_rows(features)).numpy()


@pytest.mark.parametrize("kind", [k for k in PROMPTS if k != "text"])
def test_preprocess_matches_hf_processor(served, kind):
    server, oracle = served
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


@pytest.mark.parametrize("kind", ["two images", "video"])
def test_vision_encoder_gives_hf_rows(served, kind):
    """The encoder's rows are the merger's output alone (as wide as the text model), HF's."""
    server, oracle = served
    inputs = hf_inputs(oracle, *PROMPTS[kind])
    key, grid_key = ("pixel_values", "image_grid_thw") if kind != "video" else ("pixel_values_videos", "video_grid_thw")
    out = encode(server, inputs[key].numpy(), inputs[grid_key].numpy())
    reference = hf_rows(oracle, inputs[key], inputs[grid_key], kind == "video")
    assert out.shape == reference.shape and out.shape[1] == oracle.model.config.text_config.hidden_size
    assert rel_err(out, reference) <= 1e-4


@pytest.fixture(scope="module")
def expected_tokens(served) -> dict[str, list[int]]:
    _, oracle = served
    return {kind: oracle.generate(hf_inputs(oracle, *PROMPTS[kind]), NEW_TOKENS) for kind in PROMPTS}


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_tokens_equal_hf_generate(served, expected_tokens, kind):
    server, _ = served
    assert_served_tokens(server, PROMPTS[kind], expected_tokens[kind], NEW_TOKENS)


def test_concurrent_requests_each_equal_alone(served, expected_tokens):
    """Every prompt in flight at once (batched prefill and decode, the recurrent states of several
    sequences side by side, the encoder batching items of several requests): each gets `generate`'s."""
    server, _ = served
    assert served_concurrently(server, PROMPTS, NEW_TOKENS) == expected_tokens


def test_qwen3_5_moe_stages_equal_transformers(tmp_path):
    """Qwen3.5-MoE as transformers writes its configs: ids, positions, embedding rows, greedy
    tokens and logits of every prompt equal transformers'."""
    from tests.config_variants import write_variant
    from tests.test_config_variants import assert_pipeline_equals_hf

    checkpoint = write_variant("qwen3_5_moe", "bare", tmp_path / "checkpoint")
    assert_pipeline_equals_hf("qwen3_5_moe", checkpoint, Oracle(checkpoint), list(PROMPTS.values()))
