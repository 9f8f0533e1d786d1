"""The `llm` engine on MiniCPM-V 4.5's language model (Qwen3) against the official code's golden
values (`tests/golden/minicpmv4_5/`, a copy of `shared/reference/minicpmv4_5/`; its README says how
each was made): the golden `input_ids`, with the golden `vision_embeds` at the `<unk>` runs of
`image_bound`, give the golden greedy logits (within 1e-3, the issue's bound) and tokens.

Positions are 1-D (the official `MiniCPMV` gives its Qwen3 none: 0..S-1), sent as three equal rows.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.minicpmv4_5_golden import CASES, GOLDEN
from tests.test_llm import Collector
from triton_vlm.llm import DecoderConfig, Engine, SamplingParams, prompt_logits
from triton_vlm.llm.model import DecoderModel

ATOL = 1e-3


@pytest.fixture(scope="module")
def engine():
    eng = Engine(GOLDEN, return_logits=True)
    yield eng
    eng.shutdown()


def llm_inputs(golden, case: str) -> dict:
    """Our llm's inputs for a golden case: the rows of `vision_embeds` [N, Q, D] in prompt order."""
    ids = golden[f"{case}/input_ids"].astype(np.int32)
    embeds = golden[f"{case}/vision_embeds"]
    n = len(ids)
    return dict(input_ids=ids, embeddings=embeds.reshape(-1, embeds.shape[-1]).astype(np.float32),
                mrope_position_ids=np.broadcast_to(np.arange(n, dtype=np.int64), (3, n)).copy(),
                mrope_position_delta=np.zeros(1, np.int64))


def test_the_config_reads_as_the_official_model_runs():
    config = DecoderConfig.from_checkpoint(GOLDEN)
    special = json.loads((GOLDEN / "cases.json").read_text())["tokenizer"]["special_ids"]
    generation = json.loads((GOLDEN / "cases.json").read_text())["generation"]
    assert config.family == "minicpmv4_5"
    assert config.placeholder_token_ids == (special["<unk>"],)
    assert set(config.eos_token_ids) == set(generation["terminators"])
    assert config.mrope_section == (config.rotary_dim // 2,)  # 1-D RoPE


@pytest.mark.parametrize("case", list(CASES))
def test_the_image_rows_sit_on_the_image_bound_runs(golden, case):
    """The `<unk>` tokens our decoder fills are exactly the official `image_bound` runs, in order."""
    ids = golden[f"{case}/input_ids"]
    bound = golden[f"{case}/image_bound"]
    unk = DecoderConfig.from_checkpoint(GOLDEN).placeholder_token_ids[0]
    runs = np.concatenate([np.arange(a, b) for a, b in bound]) if len(bound) else np.zeros(0, int)
    assert np.array_equal(np.flatnonzero(ids == unk), runs)
    assert golden[f"{case}/vision_embeds"].shape[:2] == (len(bound), json.loads(
        (GOLDEN / "config.json").read_text())["query_num"])


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_logits_equal_the_official_step_by_step(engine, golden, case):
    """Each of the 8 golden steps: the prompt and the golden tokens so far, run whole (no cache)."""
    inputs = llm_inputs(golden, case)
    ids, emb = torch.from_numpy(inputs["input_ids"]), torch.from_numpy(inputs["embeddings"])
    tokens, logits = golden[f"{case}/greedy_tokens"], golden[f"{case}/greedy_logits"]
    for step, (token, ref) in enumerate(zip(tokens, logits)):
        prompt = torch.cat([ids, torch.from_numpy(tokens[:step].astype(np.int32))])
        n = len(prompt)
        ours = prompt_logits(engine.model, prompt, emb, torch.arange(n).expand(3, n))
        assert torch.allclose(ours, torch.from_numpy(ref), atol=ATOL, rtol=0), (step, (ours - torch.from_numpy(ref)).abs().max())
        assert int(ours.argmax()) == int(token), step


@pytest.mark.parametrize("case", list(CASES))
def test_generation_equals_the_official_generate(engine, golden, case):
    """The engine's greedy generation (paged KV cache, decode steps) stops where the official
    `generate` does, with its tokens, every step's logits within 1e-3 of the golden ones."""
    expected = golden[f"{case}/gen_tokens"].tolist()
    col = Collector()
    engine.submit(case, **llm_inputs(golden, case), params=SamplingParams(max_tokens=8), emit=col)
    col.wait()
    assert col.ids == expected
    assert col.finish_reason == ("stop" if expected[-1] in engine.eos_token_ids else "length")
    for step, (out, ref) in enumerate(zip(col.outputs, golden[f"{case}/greedy_logits"])):
        assert torch.allclose(out.logits, torch.from_numpy(ref), atol=ATOL, rtol=0), step


def test_the_weights_are_the_language_models_only():
    """`vpm.*` and `resampler.*` (the tower) are not read into the decoder."""
    model = DecoderModel.from_checkpoint(GOLDEN)
    assert model.embed_tokens.shape == (606, 256) and len(model.layers) == 2
    assert model.lm_head is not model.embed_tokens  # tie_word_embeddings false
