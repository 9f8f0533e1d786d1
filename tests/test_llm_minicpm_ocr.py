"""The `llm` engine on MiniCPM-OCR's language model (MiniCPM-V 4.6's Qwen3.5 stack with tied word
embeddings) against transformers' `generate`: a document image read in "4x" and a text prompt,
positions plain as 4.6's. The checkpoint's language model is perturbed as in
`tests/test_llm_minicpmv.py`.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests.oracle import Oracle
from tests.test_llm import (assert_matches_generate, assert_prefill_logits_match, hf_greedy_with_logits, llm_request,
                             submit)
from tests.test_llm_minicpmv import perturbed_checkpoint
from tests.test_preprocess_minicpm_ocr import DOCUMENTS
from tests.test_preprocess_minicpmv import IMG, _media, chat
from triton_vlm.llm import Engine, SamplingParams

MAX_TOKENS = 12
PROMPTS = {
    "document": (chat(IMG + "Read the page."), [DOCUMENTS["half printed"]]),
    "text": (chat("describe the red car on the road, then the blue one behind it " * 3), []),
}


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Oracle:
    return Oracle(perturbed_checkpoint(tmp_path_factory.mktemp("minicpm_ocr-tiny"), "minicpm_ocr"))


@pytest.fixture(scope="module")
def engine(hf):
    eng = Engine(hf.checkpoint, return_logits=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def requests(hf):
    out = {}
    for name, (text, images) in PROMPTS.items():
        inputs = hf.processor(text=[text], return_tensors="pt", **_media(images))
        rows = []
        if images:
            with torch.no_grad():
                rows = hf.model.model.get_image_features(inputs["pixel_values"], inputs["target_sizes"]).pooler_output
        out[name] = llm_request(hf.model, inputs, rows)
    return out


def test_word_embeddings_are_tied(hf, engine):
    assert hf.model.config.tie_word_embeddings and engine.config.tie_word_embeddings
    head, embed = engine.model.lm_head, engine.model.embed_tokens  # one tensor: the head is a view of it
    assert head.shape == embed.shape and head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prefill_logits_match_hf(hf, engine, requests, name):
    assert_prefill_logits_match(hf.model, engine, requests[name])


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_hf_generate(hf, engine, requests, name):
    expected, logits = hf_greedy_with_logits(hf.model, requests[name], MAX_TOKENS)
    col = submit(engine, requests[name], SamplingParams(max_tokens=MAX_TOKENS), f"greedy-{name}").wait()
    assert_matches_generate(col, engine.eos_token_ids, expected, logits)
