"""The `llm` engine on Gemma 3's decoder against transformers (the tiny demo checkpoint: 5 sliding
layers of a 12-token window to 1 full, image blocks of 16 tokens, so prompts pass the window and
blocks reach past it): prompts from the HF processor, image rows from the HF model's own
`get_image_features`; prefill logits, greedy tokens and every step's logits (within 1e-4) equal
`generate` for text, one image, two images and pan-and-scan crops (each crop its own block), whole,
in chunked prefill (budgets that would end a chunk inside an image block: the scheduler never does),
and from the prefix cache (a hit that ends inside an image block).
"""
from __future__ import annotations

import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.oracle import Oracle
from tests.test_llm import (assert_matches_generate, assert_prefill_logits_match, greedy_in_steps, hf_greedy_with_logits,
                            llm_request, submit)
from tests.test_preprocess_gemma3 import chat, image
from triton_vlm.families.gemma3.processor import BOI
from triton_vlm.llm import DecoderConfig, Engine
from triton_vlm.llm.engine.sampling import SamplingParams

PROMPTS = {
    "text": (chat("describe the red car on the road, then the blue one behind it " * 2), [], False),
    "image": (chat(BOI + "what is in this image"), [image(200, 120)], False),
    "images": (chat(f"{BOI} first, then {BOI} which one is red"), [image(200, 120), image(64, 300, 1.0)], False),
    "pan-and-scan": (chat(f"look {BOI} what is it"), [image(900, 300, 2.0)], True),
}
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Oracle:
    from triton_vlm.families.demo import write_demo_checkpoint

    return Oracle(write_demo_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"), "tiny"))


@pytest.fixture(scope="module")
def engine(hf):
    eng = Engine(hf.checkpoint, return_logits=True)
    yield eng
    eng.shutdown()


def hf_inputs(hf: Oracle, prompt: str, images: list[bytes], pan_and_scan: bool) -> dict:
    import io

    from PIL import Image

    kwargs = {"images": [Image.open(io.BytesIO(b)).convert("RGB") for b in images],
              "do_pan_and_scan": pan_and_scan} if images else {}
    return hf.processor(text=[prompt], return_tensors="pt", **kwargs)


@pytest.fixture(scope="module")
def requests(hf):
    out = {}
    for name, (prompt, images, pan) in PROMPTS.items():
        inputs = hf_inputs(hf, prompt, images, pan)
        rows = []
        if images:
            with torch.no_grad():
                rows = list(hf.model.model.get_image_features(inputs["pixel_values"]).pooler_output)
        out[name] = llm_request(hf.model, inputs, rows)
        out[name]["hf_inputs"] = inputs
    return out


def test_config_read_from_checkpoint(hf, engine):
    c, text = engine.config, hf.model.config.text_config
    assert c.layer_types == tuple(text.layer_types) and c.sliding_window == text.sliding_window == 12
    assert c.kv_windows == (12, 12, 12, 12, 12, None)
    assert c.rope_theta == 1e6 and c.rope_linear_factor == 8.0 and c.sliding_rope_theta == 1e4
    assert c.scale == text.query_pre_attn_scalar ** -0.5 and c.bidirectional_media
    assert c.placeholder_token_ids == (hf.model.config.image_token_id,)
    assert set(c.eos_token_ids) == {1, 7}
    assert DecoderConfig.from_checkpoint(hf.checkpoint) == c


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prefill_logits_match_hf(hf, engine, requests, name):
    assert_prefill_logits_match(hf.model, engine, requests[name])


@pytest.mark.parametrize("budget", [512, 20, 7], ids=["whole-prompt", "chunks-of-20", "chunks-of-7"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_hf_generate(hf, engine, requests, name, budget):
    req = requests[name]
    expected, logits = hf_greedy_with_logits(hf.model, req, MAX_TOKENS)
    col, _ = greedy_in_steps(engine, hf.checkpoint, req, f"greedy-{name}-{budget}", MAX_TOKENS, budget)
    assert_matches_generate(col, engine.eos_token_ids, expected, logits)


def test_prefix_cache_hit_inside_an_image_block(hf, engine, requests):
    """A second request with the first's prompt reuses its full blocks (block size 16: hits end
    inside image blocks) and still equals transformers. A block holding the start of an image block
    is keyed by the whole block's rows (its K/V depend on them all): the same prompt with that image
    block's last row changed (beyond the cached block) is no false hit."""
    from tests.test_llm import Collector

    eng = Engine(hf.checkpoint, model=engine.model, prefix_caching=True, block_size=16, return_logits=True)
    try:
        req = requests["pan-and-scan"]
        expected, logits = hf_greedy_with_logits(hf.model, req, MAX_TOKENS)
        starts = np.flatnonzero(req["llm"]["input_ids"] == engine.config.placeholder_token_ids[0])[::16]
        inside = [k for k, a in enumerate(starts) if a % 16]  # image blocks starting inside a cache block
        assert inside
        for i in range(2):
            hits = eng.blocks.hits
            col = submit(eng, req, SamplingParams(max_tokens=MAX_TOKENS), f"cached-{i}").wait()
            assert_matches_generate(col, engine.eos_token_ids, expected, logits)
        assert eng.blocks.hits > hits
        embeddings = req["llm"]["embeddings"].copy()
        embeddings[inside[0] * 16 + 15] += 1.0  # an image block's last row, in the cache block after its start
        llm = dict(req["llm"], embeddings=embeddings)
        changed, ref = Collector(), Collector()
        eng.submit("changed", **llm, params=SamplingParams(max_tokens=MAX_TOKENS), emit=changed)
        fresh = Engine(hf.checkpoint, model=engine.model, block_size=16, return_logits=True)
        fresh.submit("ref", **llm, params=SamplingParams(max_tokens=MAX_TOKENS), emit=ref)
        assert changed.wait().ids == ref.wait().ids
        for ours, theirs in zip(changed.outputs, ref.outputs):
            assert torch.allclose(ours.logits, theirs.logits, atol=1e-5, rtol=0)
        fresh.shutdown()
    finally:
        eng.shutdown()


def test_a_chunk_never_ends_inside_a_span():
    from triton_vlm.llm.engine.scheduler import chunk_end

    class Seq:
        spans = ((5, 21), (30, 46))
        num_computed = 0

    seq = Seq()
    assert [chunk_end(seq, e) for e in (4, 5, 6, 20, 21, 29, 31)] == [4, 5, 5, 5, 21, 29, 30]
    seq.num_computed = 8  # a prefix-cache hit inside the first span: the chunk takes the rest of it
    assert [chunk_end(seq, e) for e in (9, 21, 22)] == [21, 21, 22]


@pytest.mark.parametrize("key, value, named", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
     "rope_parameters.full_attention.rope_type 'yarn'"),
    ("hidden_activation", "silu", "hidden_act 'silu'"),
])
def test_configs_it_does_not_implement_are_refused_naming_the_key(hf, tmp_path, key, value, named):
    import json
    import shutil

    checkpoint = shutil.copytree(hf.checkpoint, tmp_path / "ckpt")
    config = json.loads((checkpoint / "config.json").read_text())
    config["text_config"][key] = value
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match=re.escape(named)):
        DecoderConfig.from_checkpoint(checkpoint)
