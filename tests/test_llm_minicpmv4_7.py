"""The `llm` engine on MiniCPM-V 4.7's language model (4.6's Qwen3.5 hybrid stack) with canvas
M-RoPE positions, against transformers' `generate` (which computes them with `get_rope_index` and
decodes with its `rope_deltas`).

Prompts and media rows come from the HF processor and model (`get_image_features`,
`get_video_features`, rows put in prompt order); positions and delta from `get_rope_index`. The
checkpoint's language model is perturbed as in `tests/test_llm_minicpmv.py`, so a wrong position
shows in the logits.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.oracle import Oracle
from tests.test_llm import (assert_matches_generate, assert_prefill_logits_match, greedy_in_steps,
                            hf_greedy_with_logits, llm_request)
from tests.test_llm_minicpmv import perturbed_checkpoint
from tests.test_preprocess_minicpmv import IMG, VID, _media, chat, image, video
from triton_vlm.llm import Engine

MAX_TOKENS = 12
PROMPTS = {
    "image": (chat(IMG + "What is in the picture?"), [image(640, 480)], []),
    "several images": (chat(IMG + "and" + IMG + "?"), [image(1920, 1080), image(200, 100)], []),
    "video": (chat(VID + "What moves?"), [], [video(2, 4, 320, 240)]),
    "mix": (chat(IMG + "then" + VID + IMG), [image(640, 480), image(448, 448)], [video(2, 4)]),
}


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Oracle:
    return Oracle(perturbed_checkpoint(tmp_path_factory.mktemp("minicpmv4_7-tiny"), "minicpmv4_7"))


@pytest.fixture(scope="module")
def engine(hf):
    eng = Engine(hf.checkpoint, return_logits=True)
    yield eng
    eng.shutdown()


@torch.no_grad()
def prompt_order_rows(model, inputs) -> list[torch.Tensor]:
    """Each crop's embedding rows (HF's own), in the order the crops stand in the prompt."""
    feats = {}
    if "pixel_values" in inputs:
        feats[1] = iter(model.model.get_image_features(inputs["pixel_values"], inputs["target_sizes"]).pooler_output)
    if "pixel_values_videos" in inputs:
        feats[2] = iter(model.model.get_video_features(inputs["pixel_values_videos"],
                                                       inputs["target_sizes_videos"]).pooler_output)
    kinds = inputs["mm_token_type_ids"][0].tolist()
    return [next(feats[k]) for i, k in enumerate(kinds) if k and (i == 0 or kinds[i - 1] != k)]


@pytest.fixture(scope="module")
def requests(hf):
    out = {}
    for name, (text, images, videos) in PROMPTS.items():
        inputs = hf.processor(text=[text], return_tensors="pt", **_media(images, videos))
        positions, delta = hf.model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], target_sizes=inputs.get("target_sizes"),
            target_sizes_videos=inputs.get("target_sizes_videos"))
        assert int(delta[0, 0]) < 0
        out[name] = llm_request(hf.model, inputs, prompt_order_rows(hf.model, inputs), positions, delta)
    return out


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prefill_logits_match_hf(hf, engine, requests, name):
    assert_prefill_logits_match(hf.model, engine, requests[name])


@pytest.mark.parametrize("budget", [512, 16], ids=["whole-prompt", "chunked-prefill"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_hf_generate(hf, engine, requests, name, budget):
    """Same tokens as HF generate, every step's logits within 1e-4: the decode steps continue from
    the canvas delta."""
    req = requests[name]
    expected, logits = hf_greedy_with_logits(hf.model, req, MAX_TOKENS)
    col, _ = greedy_in_steps(engine, hf.checkpoint, req, f"greedy-{name}-{budget}", MAX_TOKENS, budget)
    assert_matches_generate(col, engine.eos_token_ids, expected, logits)


def test_preprocess_gives_the_engine_its_positions(hf, requests):
    """`preprocess` on the same prompt gives the ids, positions and delta these requests carry."""
    from triton_vlm.preprocessing.preprocessor import Preprocessor

    pre = Preprocessor(hf.checkpoint)
    for name, (text, images, videos) in PROMPTS.items():
        ours, llm = pre(text, images, videos), requests[name]["llm"]
        np.testing.assert_array_equal(ours.input_ids, llm["input_ids"])
        np.testing.assert_array_equal(ours.mrope_position_ids, llm["mrope_position_ids"])
        assert ours.mrope_position_delta == int(llm["mrope_position_delta"][0])


def test_sequences_of_a_hybrid_decoder_each_equal_transformers(hf, engine, requests):
    """`num_return_sequences` on a decoder with a recurrent state: the other sequences recompute the
    prompt (no shared state) and each greedy sequence is transformers' answer."""
    from tests.test_llm_sequences import Sequences
    from triton_vlm.llm import SamplingParams

    req = requests["image"]
    expected, _ = hf_greedy_with_logits(hf.model, req, MAX_TOKENS)
    group = Sequences()
    engine.submit("hybrid-n2", **req["llm"], params=SamplingParams(max_tokens=MAX_TOKENS, num_return_sequences=2),
                  emit=group)
    group.wait()
    assert [group.ids(0), group.ids(1)] == [expected, expected] and group.finals == 1
    assert engine.kv_blocks_used == 0 and engine.blocks.num_states_used == 0
