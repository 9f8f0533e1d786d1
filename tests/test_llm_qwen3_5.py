"""The `llm` engine on Qwen3.5's decoder (`qwen3_5_text`: the hybrid stack of Gated DeltaNet and
gated full-attention layers, (1 + w) norms, partial interleaved M-RoPE, no DeepStack) and
Qwen3.5-MoE's (every layer's MLP the softmax-routed experts plus a sigmoid-gated shared expert),
against transformers as the oracle (a tiny random checkpoint of each, CPU).

Inputs are Qwen3-VL's tests' prompts (`tests/test_llm_qwen3_vl.py`) through the checkpoint's HF
processor (Qwen3-VL's); vision rows from the HF model's own `get_image_features` /
`get_video_features` (the merger's output alone); positions from `get_rope_index`. The checkpoints' language models are perturbed as in `tests/test_llm_minicpmv.py`
(their (1 + w) norms start at zero), so a wrong position or a dropped shared expert shows in the
logits. Prompts are prefilled whole and in chunks of a few tokens (runs of the recurrent state
cut across steps).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests.oracle import Oracle
from tests.test_llm import (assert_chunked_concurrent_equal_alone, assert_matches_generate,
                            assert_prefill_logits_match, greedy_in_steps, hf_greedy_with_logits)
from tests.test_llm_minicpmv import perturbed_checkpoint
from tests.test_llm_qwen3_vl import MAX_TOKENS, PROMPTS, prompt_requests
from triton_vlm.llm import DecoderConfig, Engine
from triton_vlm.llm.layers.moe import MoeConfig, softmax_route


@pytest.fixture(scope="module", params=("qwen3_5", "qwen3_5_moe"))
def qwen3_5(request, tmp_path_factory):
    """One variant: its (perturbed) checkpoint, the HF oracle, one engine (per-step logits on)."""
    ckpt = perturbed_checkpoint(tmp_path_factory.mktemp(f"{request.param}-tiny"), request.param)
    engine = Engine(ckpt, return_logits=True)
    yield Oracle(ckpt), engine
    engine.shutdown()


@pytest.fixture(scope="module")
def requests(qwen3_5):
    hf, _ = qwen3_5
    return prompt_requests(hf)


@pytest.fixture(scope="module")
def expected(qwen3_5, requests):
    """HF greedy tokens and per-step logits of every prompt."""
    hf, _ = qwen3_5
    return {name: hf_greedy_with_logits(hf.model, req, MAX_TOKENS) for name, req in requests.items()}


def test_config_read_from_checkpoint(qwen3_5):
    hf, engine = qwen3_5
    c, cfg = engine.config, hf.model.config
    text = cfg.text_config
    assert c.family == cfg.model_type and c.mrope_interleaved
    assert c.layer_types == tuple(text.layer_types) == ("linear_attention", "full_attention") * 2
    assert c.head_dim == text.head_dim == 32 and c.rotary_dim == 8
    assert c.mrope_section == tuple(text.rope_parameters["mrope_section"])
    assert c.placeholder_token_ids == (cfg.image_token_id, cfg.video_token_id)
    assert c.deepstack_maps == 0 and c.embedding_width == text.hidden_size
    assert not hasattr(cfg.vision_config, "deepstack_visual_indexes")
    if cfg.model_type == "qwen3_5_moe":
        assert c.moe == MoeConfig(num_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
                                  routed_scaling_factor=1.0, moe_intermediate_size=32, n_shared_experts=0,
                                  first_k_dense_replace=0)
        assert c.moe_layers == (True,) * 4
        assert all(hasattr(layer, "moe") for layer in engine.model.layers)
    else:
        assert c.moe is None
    assert DecoderConfig.from_checkpoint(hf.checkpoint) == c


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prefill_logits_match_hf(qwen3_5, requests, name):
    hf, engine = qwen3_5
    assert_prefill_logits_match(hf.model, engine, requests[name])


@pytest.mark.parametrize("budget", [512, 7], ids=["whole-prompt", "chunked-prefill"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_hf_generate(qwen3_5, requests, expected, name, budget):
    """Same tokens as HF generate, every step's logits within 1e-4 of HF's, the prompt prefilled
    whole or 7 tokens a step (vision runs and the recurrent state carried across steps)."""
    hf, engine = qwen3_5
    col, steps = greedy_in_steps(engine, hf.checkpoint, requests[name], f"greedy-{name}-{budget}", MAX_TOKENS,
                                 budget)
    if budget == 7:
        assert steps > int(requests[name]["llm"]["input_ids"].size) // 7
    assert_matches_generate(col, engine.eos_token_ids, *expected[name])


def test_concurrent_requests_equal_alone(qwen3_5, requests):
    _, engine = qwen3_5
    assert_chunked_concurrent_equal_alone(engine, {k: requests[k] for k in ("text", "image", "image+video")})


def test_moe_router_and_shared_expert_match_hf(qwen3_5):
    """Qwen3.5-MoE's router (expert ids and weights) and its whole MLP (routed experts plus the
    sigmoid-gated shared expert) equal `Qwen3_5MoeSparseMoeBlock`'s; the dense variant has none."""
    hf, engine = qwen3_5
    assert any(hasattr(layer, "moe") for layer in engine.model.layers) == (engine.config.moe is not None)
    x = torch.randn(257, engine.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for i, layer in enumerate(engine.model.layers):
        if hasattr(layer, "moe"):
            block = hf.model.model.language_model.layers[i].mlp
            with torch.no_grad():
                _, ref_w, ref_ids = block.gate(x)
                ref = block(x[None])[0]
                shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
            w, ids = softmax_route(x, layer.moe.router, engine.config.moe.num_experts_per_tok)
            assert torch.equal(ids, ref_ids) and torch.allclose(w, ref_w, atol=1e-6, rtol=0)
            out = layer.moe(x)
            assert torch.allclose(out, ref, atol=1e-5, rtol=0), (out - ref).abs().max()
            assert shared.abs().max() > 1e-3  # the shared expert counts: dropping it would show


def test_config_keys_not_implemented_are_refused_by_name(qwen3_5, tmp_path):
    """q/k/v/o biases (`attention_bias`) are not implemented, and Qwen3.5-MoE's model never reads
    `mlp_only_layers`: a config setting either is refused, naming the key."""
    import json
    import shutil

    hf, engine = qwen3_5
    keys = ["attention_bias"] + (["mlp_only_layers"] if engine.config.moe else [])
    for key in keys:
        checkpoint = shutil.copytree(hf.checkpoint, tmp_path / key)
        config = json.loads((checkpoint / "config.json").read_text())
        config["text_config"][key] = [1] if key == "mlp_only_layers" else True
        (checkpoint / "config.json").write_text(json.dumps(config))
        with pytest.raises(NotImplementedError, match=f"{config['model_type']}: text_config {key} is not supported"):
            DecoderConfig.from_checkpoint(checkpoint)
