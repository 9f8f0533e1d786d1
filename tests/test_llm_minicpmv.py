"""The `llm` engine on MiniCPM-V 4.6's language model, the Qwen3.5 hybrid stack (`qwen3_5_text`:
3 Gated DeltaNet linear-attention layers + 1 gated full-attention layer in the tiny checkpoint),
against transformers as the oracle (CPU: its torch reference conv / delta-rule implementations).

Prompts come from the HF processor; image rows from the HF model's own `get_image_features`;
positions are 1-D (what `MiniCPMV4_6Model` gives its text model), sent as [3, S] rows and delta 0.
The demo checkpoint's RMSNorm weights are all zero (Qwen3.5 scales by 1 + weight) and its weights
small; the fixture perturbs and scales them and saves the checkpoint again, so a wrong norm offset
or a slightly wrong state shows in the logits.
"""
from __future__ import annotations

import os
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.oracle import Oracle
from tests.test_llm import (
    Collector,
    assert_matches_generate,
    assert_prefill_logits_match,
    assert_same,
    greedy_in_steps,
    hf_greedy_with_logits,
    llm_request,
    submit,
)
from triton_vlm.llm import DecoderConfig, Engine, SamplingParams, prompt_logits

PROMPTS = {
    "text": "describe the red car on the road, then the blue one behind it, then the trees " * 4,
    "image": "<|image_pad|>what is in this image",
}
MAX_TOKENS = 16


def perturbed_checkpoint(out, family: str = "minicpmv4_6"):
    """The family's tiny demo checkpoint with its language model's norm weights (and dt_bias)
    perturbed and its other weights scaled (see the module docstring), saved again."""
    from transformers import AutoModelForImageTextToText

    from triton_vlm.families.demo import write_demo_checkpoint

    ckpt = write_demo_checkpoint(family, out, "tiny")
    model = AutoModelForImageTextToText.from_pretrained(ckpt)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and ("norm" in name or "dt_bias" in name):
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "language_model" in name or name.startswith("lm_head"):
                p.mul_(4.0)
    model.save_pretrained(ckpt)
    return ckpt


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Oracle:
    return Oracle(perturbed_checkpoint(tmp_path_factory.mktemp("minicpmv4_6-tiny")))


@pytest.fixture(scope="module")
def engine(hf):
    eng = Engine(hf.checkpoint, return_logits=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def requests(hf):
    from PIL import Image

    model = hf.model
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (120, 200, 3), dtype=np.uint8))
    out = {}
    for name, text in PROMPTS.items():
        prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        inputs = hf.processor(text=[prompt], return_tensors="pt", **({"images": [image]} if name == "image" else {}))
        rows = []
        if "pixel_values" in inputs:
            with torch.no_grad():
                rows = model.model.get_image_features(inputs["pixel_values"], inputs["target_sizes"]).pooler_output
        assert bool(rows) == (name == "image")
        out[name] = llm_request(model, inputs, rows)
    assert out["image"]["llm"]["embeddings"].shape[0] > 4  # overview image and slices
    return out


def test_config_read_from_checkpoint(hf, engine):
    c, cfg = engine.config, hf.model.config
    text = cfg.text_config
    assert c.layer_types == tuple(text.layer_types) and "linear_attention" in c.layer_types
    assert c.kv_layers == tuple(i for i, t in enumerate(text.layer_types) if t == "full_attention")
    lin = c.linear_attention
    assert (lin.num_k_heads, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim, lin.conv_kernel) == (
        text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
        text.linear_value_head_dim, text.linear_conv_kernel_dim)
    assert c.rotary_dim == int(text.head_dim * text.rope_parameters["partial_rotary_factor"]) < c.head_dim
    assert c.mrope_interleaved and c.mrope_section == tuple(text.rope_parameters["mrope_section"])
    assert c.placeholder_token_ids == (cfg.image_token_id, cfg.video_token_id)
    assert set(c.eos_token_ids) == set(text.eos_token_id)
    assert DecoderConfig.from_checkpoint(hf.checkpoint) == c
    # K/V only for the full-attention layers; one state slot per running sequence for the others
    assert engine.runner.kv.k.shape[0] == len(c.kv_layers)
    assert engine.runner.states.conv.shape[0] == c.num_layers - len(c.kv_layers)
    assert engine.runner.states.max_slots == engine.scheduler.max_running
    # prefix caching is off for a decoder with a recurrent state, even when asked for
    eng = Engine(hf.checkpoint, model=engine.model, prefix_caching=True)
    try:
        assert not eng.prefix_caching and not eng.blocks.prefix_caching
    finally:
        eng.shutdown()


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prefill_logits_match_hf(hf, engine, requests, name):
    assert_prefill_logits_match(hf.model, engine, requests[name])


def test_interleaved_mrope_matches_hf(hf, engine, requests):
    """Distinct temporal / height / width positions (as a 3-D grid would give) rotate as
    transformers' interleaved M-RoPE does (its text model takes [3, batch, S] positions)."""
    ids = torch.from_numpy(requests["text"]["llm"]["input_ids"]).long()
    n = ids.numel()
    positions = torch.stack([torch.arange(n) // 4, torch.arange(n) % 7, torch.arange(n) % 5 + 2])
    lm = hf.model.model.language_model
    with torch.no_grad():
        hidden = lm(inputs_embeds=lm.embed_tokens(ids)[None], position_ids=positions[:, None]).last_hidden_state
        ref = hf.model.lm_head(hidden[0, -1])
    logits = prompt_logits(engine.model, ids, None, positions)
    assert torch.allclose(logits, ref, atol=1e-4, rtol=0), (logits - ref).abs().max()


@pytest.mark.parametrize("budget", [512, 16], ids=["whole-prompt", "chunked-prefill"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_hf_generate(hf, engine, requests, name, budget):
    """Same tokens as HF generate, every step's logits within 1e-4; with a 16-token step budget the
    prompt is prefilled in chunks, the linear layers' states carried from chunk to chunk."""
    req = requests[name]
    inputs = req["hf_inputs"]
    assert inputs["input_ids"].shape[1] > 2 * 16
    expected, logits = hf_greedy_with_logits(hf.model, req, MAX_TOKENS)
    col, steps = greedy_in_steps(engine, hf.checkpoint, req, f"greedy-{name}-{budget}", MAX_TOKENS, budget)
    assert steps == len(col.ids) - 1 + -(-inputs["input_ids"].shape[1] // budget)
    assert_matches_generate(col, engine.eos_token_ids, expected, logits)
    assert engine.blocks.num_states_used == 0


def _jobs() -> list[tuple[str, SamplingParams]]:
    jobs = []
    for i, name in enumerate(PROMPTS):
        jobs.append((name, SamplingParams(max_tokens=10 + 2 * i)))
        jobs.append((name, SamplingParams(max_tokens=12 - i, temperature=0.9, top_k=50, top_p=0.9, seed=7 + i)))
    return jobs


def test_concurrent_requests_equal_alone(hf, engine, requests):
    """Greedy and seeded requests of both prompts at once, prompts prefilled in 16-token chunks beside
    other requests' decode steps, at most 3 running (a finished sequence's state slot is reused):
    each equals its run alone."""
    eng = Engine(hf.checkpoint, model=engine.model, kv_cache_tokens=2048, max_num_tokens=16, max_running=3,
                 return_logits=True)
    jobs = _jobs()
    try:
        alone = [submit(eng, requests[n], p, f"alone-{i}").wait() for i, (n, p) in enumerate(jobs)]
        seen = []
        cols = [submit(eng, requests[n], p, f"conc-{i}",
                       on_emit=lambda c: seen.append((eng.num_running, eng.blocks.num_states_used)))
                for i, (n, p) in enumerate(jobs)]
        together = [c.wait() for c in cols]
        assert_same(together, alone)
        assert max(r for r, _ in seen) > 1 and all(s <= 3 for _, s in seen)
        assert eng.runner.states.capacity == 3  # grown to the running sequences, not past max_running
        assert eng.kv_blocks_used == 0 and eng.blocks.num_states_used == 0
        assert (eng.num_running, eng.num_waiting) == (0, 0)
    finally:
        eng.shutdown()


def test_cancel_mid_decode_frees_blocks_and_state(engine, requests):
    stop_after = 3
    col, other = Collector(), Collector()
    engine.submit("cancel-me", **requests["image"]["llm"], params=SamplingParams(max_tokens=64), emit=col,
                  is_cancelled=lambda: len(col.outputs) >= stop_after)
    engine.submit("keeps-going", **requests["text"]["llm"], params=SamplingParams(max_tokens=8), emit=other)
    col.wait()
    assert col.finish_reason == "cancelled" and len(col.ids) == stop_after
    assert other.wait().finish_reason in ("stop", "length")
    assert engine.kv_blocks_used == 0 and engine.blocks.num_states_used == 0 and engine.num_running == 0
    # a request cancelled before it ran never took a slot
    gate = threading.Event()
    slow = submit(engine, requests["text"], SamplingParams(max_tokens=4), "slow", on_emit=lambda c: gate.wait(60))
    waiting = submit(engine, requests["text"], SamplingParams(max_tokens=4), "waiting")
    engine.cancel("waiting")
    gate.set()
    assert waiting.wait().finish_reason == "cancelled" and waiting.ids == []
    slow.wait()
    assert engine.kv_blocks_used == 0 and engine.blocks.num_states_used == 0


def test_preemption_under_small_pool_gives_same_tokens(hf, engine, requests):
    """A KV pool that holds little more than the longest request: sequences are preempted (blocks and
    state slot dropped) and recomputed from their prompt; the tokens do not change."""
    jobs = _jobs()
    ref = Engine(hf.checkpoint, model=engine.model, kv_cache_tokens=4096, max_num_tokens=24, return_logits=True)
    try:
        alone = [submit(ref, requests[n], p, f"ref-{i}").wait() for i, (n, p) in enumerate(jobs)]
    finally:
        ref.shutdown()
    longest = max(int(requests[n]["llm"]["input_ids"].size) + p.max_tokens for n, p in jobs)
    eng = Engine(hf.checkpoint, model=engine.model, kv_cache_tokens=longest + 16, block_size=8, max_num_tokens=24,
                 return_logits=True)
    try:
        cols = [submit(eng, requests[n], p, f"p-{i}") for i, (n, p) in enumerate(jobs)]
        together = [c.wait() for c in cols]
        assert eng.num_preempted > 0
        assert_same(together, alone)
        assert eng.kv_blocks_used == 0 and eng.blocks.num_states_used == 0
    finally:
        eng.shutdown()
