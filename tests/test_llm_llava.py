"""Issue #28: the `llm` engine on LLaVA's language models, Llama and Qwen2 with 1-D RoPE (positions
0..S-1 given as three equal `mrope_position_ids` rows, delta 0), against transformers: prompts from
the HF processor, image rows from the HF model's own `get_image_features`; prefill logits, greedy
tokens and every step's logits (within 1e-4) equal `generate` for text, one image and several
images, whole and in chunked prefill.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.oracle import Oracle
from tests.test_llm import (assert_matches_generate, assert_prefill_logits_match, greedy_in_steps, hf_greedy_with_logits,
                            llm_request)
from tests.test_preprocess_llava import chat, hf_inputs, image, llava_checkpoints  # noqa: F401 (fixture)
from triton_vlm.families.llava.processor import IMAGE_TOKEN as IMG
from triton_vlm.llm import DecoderConfig, Engine

# One checkpoint per decoder (text_config.model_type).
DECODERS = {"llama": "clip-llama", "qwen2": "siglip-qwen2-3layers-default"}
PROMPTS = {
    "text": (chat("describe the red car on the road, then the blue one behind it " * 3), []),
    "image": (chat(IMG + "\nwhat is in this image"), [image(200, 120)]),
    "images": (chat(f"{IMG} first, then {IMG}{IMG} which one is red"), [image(200, 120), image(64, 300, 1.0),
                                                                         image(640, 480, 2.0)]),
}
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=list(DECODERS))
def hf(request, llava_checkpoints) -> Oracle:
    return Oracle(llava_checkpoints[DECODERS[request.param]])


@pytest.fixture(scope="module")
def engine(hf):
    eng = Engine(hf.checkpoint, return_logits=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def requests(hf):
    out = {}
    for name, (prompt, images) in PROMPTS.items():
        inputs = hf_inputs(hf, prompt, images)
        rows = []
        if images:
            with torch.no_grad():
                rows = list(hf.model.model.get_image_features(inputs["pixel_values"]).pooler_output)
        out[name] = llm_request(hf.model, inputs, rows)
    return out


def test_config_read_from_checkpoint(hf, engine):
    c, cfg = engine.config, hf.model.config
    text = cfg.text_config
    assert c.text_model_type == text.model_type
    assert c.mrope_section == (c.head_dim // 2,) and c.rotary_dim == c.head_dim
    assert c.placeholder_token_ids == (cfg.image_token_id,)
    assert c.rope_theta == text.rope_parameters["rope_theta"]
    assert DecoderConfig.from_checkpoint(hf.checkpoint) == c


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prefill_logits_match_hf(hf, engine, requests, name):
    assert_prefill_logits_match(hf.model, engine, requests[name])


@pytest.mark.parametrize("budget", [512, 16], ids=["whole-prompt", "chunked-prefill"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_hf_generate(hf, engine, requests, name, budget):
    req = requests[name]
    expected, logits = hf_greedy_with_logits(hf.model, req, MAX_TOKENS)
    col, _ = greedy_in_steps(engine, hf.checkpoint, req, f"greedy-{name}-{budget}", MAX_TOKENS, budget)
    assert_matches_generate(col, engine.eos_token_ids, expected, logits)


def test_embedding_rows_must_match_the_image_tokens(engine, requests):
    from triton_vlm.errors import InvalidInput

    llm = dict(requests["image"]["llm"])
    llm["embeddings"] = llm["embeddings"][1:]
    with pytest.raises(InvalidInput, match="embeddings: .* rows given, prompt has .* image/video placeholder tokens"):
        engine.model.placeholder_rows(torch.from_numpy(llm["input_ids"]), torch.from_numpy(llm["embeddings"]))
    assert np.count_nonzero(requests["images"]["llm"]["input_ids"] == engine.config.placeholder_token_ids[0]) \
        == requests["images"]["llm"]["embeddings"].shape[0]
