"""Qwen3.5 end to end behind a real tritonserver, and Qwen3.5-MoE through the same stages in this
process, both checked against transformers in the same run.

The prompts are Qwen3-VL's end-to-end tests' (`tests/test_e2e_qwen3_vl.py`). Qwen3.5 (a tiny demo
checkpoint, its configs "varied": `tests/config_variants.py`): `preprocess`
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

import pytest

from tests.encoder_checks import encode, rel_err
from tests.oracle import Oracle
from tests.test_e2e import assert_served_tokens, family_server, served_concurrently
from tests.test_e2e_qwen3_vl import NEW_TOKENS, PROMPTS, assert_preprocess_equals_hf, hf_inputs, hf_rows


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(running server, oracle) for Qwen3.5's tiny checkpoint; the server is stopped after."""
    with family_server("qwen3_5", tmp_path_factory.mktemp("qwen3_5"), "varied") as served:
        yield served


@pytest.mark.parametrize("kind", [k for k in PROMPTS if k != "text"])
def test_preprocess_matches_hf_processor(served, kind):
    server, oracle = served
    assert_preprocess_equals_hf(server, oracle, *PROMPTS[kind])


@pytest.mark.parametrize("kind", ["two images", "video"])
def test_vision_encoder_gives_hf_rows(served, kind):
    """The encoder's rows are the merger's output alone (as wide as the text model: no DeepStack
    maps), HF's."""
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
