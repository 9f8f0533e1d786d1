"""The `llm` engine on GLM-4.5V's mixture-of-experts decoder (`glm4v_moe`) against transformers as
the oracle (tiny random checkpoint, CPU).

The tiny demo checkpoint (`write_demo_checkpoint("glm4v_moe")`) has a dense first layer and two MoE layers with grouped,
biased routing: the routers' `e_score_correction_bias` is random (transformers initialises it to
zero, which would leave the biased choice untested), and one multi-token-prediction layer
(`layers.{num_hidden_layers}.*`) is appended to the saved weights, as released GLM-4.5V weights
hold one that is not loaded.

Inputs come from the HF processor (GLM-4.1V's); vision rows from the HF model's own
`get_image_features`; positions from its `get_rope_index`.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.oracle import Oracle
from tests.test_llm import (assert_chunked_concurrent_equal_alone, assert_matches_generate, assert_prefill_logits_match,
                            hf_greedy_with_logits, llm_request, submit)
from tests.test_llm_dtype import greedy_steps_within_tolerance, tolerance
from triton_vlm.llm import DecoderConfig, DecoderModel, Engine, SamplingParams, prompt_logits
from triton_vlm.llm.layers.moe import MoeConfig, route, run_experts

PROMPTS = {
    "text": "describe the red car on the road",
    "image": "<|begin_of_image|><|image|><|end_of_image|>what is in this image",
}
TEMPLATE = "[gMASK]<sop><|user|>\n{}<|assistant|>\n"
MAX_TOKENS = 16

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from triton_vlm.families.demo import write_demo_checkpoint

    return write_demo_checkpoint("glm4v_moe", tmp_path_factory.mktemp("glm4v_moe-tiny"), "tiny")


@pytest.fixture(scope="module")
def moe(ckpt):
    """The HF oracle and one engine (per-step logits on)."""
    engine = Engine(ckpt, return_logits=True)
    yield Oracle(ckpt), engine
    engine.shutdown()


def make_requests(model, processor) -> dict:
    """Per prompt: HF processor inputs and the `llm` inputs made from them (vision rows as float32)."""
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    out = {}
    for name, text in PROMPTS.items():
        media = dict(images=[image]) if name == "image" else {}
        inputs = processor(text=[TEMPLATE.format(text)], return_tensors="pt", **media)
        with torch.no_grad():
            rows = []
            if "pixel_values" in inputs:
                rows += model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
            pos, delta = model.model.get_rope_index(
                inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                image_grid_thw=inputs.get("image_grid_thw"))
        assert bool(rows) == (name != "text")
        out[name] = llm_request(model, inputs, [r.float() for r in rows], pos, delta)
    return out


@pytest.fixture(scope="module")
def requests(moe):
    hf, _ = moe
    return make_requests(hf.model, hf.processor)


# ---- config and loading --------------------------------------------------------------------------

def test_config_reads_moe_settings(moe):
    hf, engine = moe
    c, text = engine.config, hf.model.config.text_config
    assert c.family == "glm4v_moe"
    assert c.moe == MoeConfig(num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=True,
                              routed_scaling_factor=2.5, moe_intermediate_size=32, n_shared_experts=1,
                              first_k_dense_replace=1)
    assert c.moe.num_experts == text.n_routed_experts and c.moe.first_k_dense_replace == text.first_k_dense_replace
    assert c.moe_layers == (False, True, True)
    assert (c.num_layers, c.head_dim, c.rotary_dim, c.mrope_section) == (3, 32, 16, (2, 3, 3))
    assert c.placeholder_token_ids == (hf.model.config.image_token_id,)
    assert DecoderConfig.from_checkpoint(hf.checkpoint) == c
    # dense layers are Qwen2's; the others carry the MoE, with 3-D expert weights
    layers = engine.model.layers
    assert [hasattr(layer, "moe") for layer in layers] == [False, True, True]
    assert layers[0].w_gate_up.shape == (2 * text.intermediate_size, text.hidden_size)
    assert layers[1].moe.gate_up.shape == (8, 2 * 32, 64) and layers[1].moe.down.shape == (8, 64, 32)


def test_dense_configs_have_no_moe(tmp_path):
    """A dense family's config reads no MoE settings: all its layers are dense."""
    from triton_vlm.families.demo import write_demo_checkpoint

    c = DecoderConfig.from_checkpoint(write_demo_checkpoint("qwen2_5_vl", tmp_path, "tiny"))
    assert c.moe is None and c.moe_layers == (False,) * c.num_layers


def test_mtp_layer_is_not_loaded(ckpt, monkeypatch):
    """The checkpoint holds a layer past `num_hidden_layers` (GLM-4.5V's multi-token prediction):
    our loader does not read any of its tensors. transformers does not load it either, but for this
    tiny model it reports the keys as UNEXPECTED (its ignore patterns name the released sizes'
    layers 46 and 92 only)."""
    from safetensors import safe_open
    from transformers import Glm4vMoeForConditionalGeneration

    import triton_vlm.llm.model as model_module

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        mtp = {k for k in f.keys() if ".layers.3." in k}
    assert {k.split(".layers.3.")[1] for k in mtp} >= {"eh_proj.weight", "enorm.weight", "mlp.gate.weight",
                                                         "mlp.experts.0.gate_proj.weight"}
    read, original = [], model_module.read_safetensors

    def spy(root, rename, **kw):
        def recorded(k):
            name = rename(k)
            if name is not None:
                read.append(k)
            return name
        return original(root, recorded, **kw)

    monkeypatch.setattr(model_module, "read_safetensors", spy)
    for dtype in ("float32", "bfloat16"):
        read.clear()
        DecoderModel.from_checkpoint(ckpt, dtype=dtype)
        assert read and not mtp & set(read)
        assert any(".layers.2.mlp.experts.7." in k for k in read)

    _, info = Glm4vMoeForConditionalGeneration.from_pretrained(ckpt, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(".layers.3." in k for k in info["unexpected_keys"])


# ---- the router and the experts ------------------------------------------------------------------

def test_router_matches_hf(moe):
    """Expert ids and weights equal `Glm4vMoeTextTopkRouter`'s on random hidden states, for every
    MoE layer; the random correction bias changes some of the choices."""
    hf, engine = moe
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(257, engine.config.hidden_size, generator=gen)
    changed = 0
    for i, layer in enumerate(engine.model.layers):
        if not hasattr(layer, "moe"):
            continue
        ref_router = hf.model.model.language_model.layers[i].mlp.gate
        assert bool(ref_router.e_score_correction_bias.abs().max() > 0)
        with torch.no_grad():
            _, ref_w, ref_ids = ref_router(x)
        w, ids = layer.moe.route(x)
        assert w.dtype == torch.float32
        order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
        assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
        assert torch.allclose(w.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6, rtol=0)
        assert torch.allclose(w.sum(-1), torch.full((len(x),), engine.config.moe.routed_scaling_factor))
        # the same router without its bias chooses otherwise for some rows
        _, unbiased = route(x, layer.moe.router, torch.zeros_like(layer.moe.bias), engine.config.moe)
        changed += int((ids.sort(-1).values != unbiased.sort(-1).values).any(-1).sum())
    assert changed > 0


def test_moe_block_matches_hf(moe):
    """One MoE block (routed experts batched over the rows, plus the shared experts) equals
    `Glm4vMoeTextMoE` on random rows, every expert chosen by some row."""
    hf, engine = moe
    x = torch.randn(512, engine.config.hidden_size, generator=torch.Generator().manual_seed(4))
    layer = engine.model.layers[2]
    _, ids = layer.moe.route(x)
    assert ids.unique().numel() == engine.config.moe.num_experts
    with torch.no_grad():
        ref = hf.model.model.language_model.layers[2].mlp(x[None])[0]
    assert torch.allclose(layer.moe(x), ref, atol=1e-5, rtol=0), (layer.moe(x) - ref).abs().max()


def test_fused_expert_layout_loads_the_same(moe, requests):
    """Weights in transformers' in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I], what its state_dict holds) give the same logits as the
    per-expert layout `save_pretrained` writes."""
    hf, engine = moe
    state = hf.model.state_dict()
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" in state
    fused = DecoderModel(engine.config, state)
    assert torch.equal(fused.layers[1].moe.gate_up, engine.model.layers[1].moe.gate_up)
    assert torch.equal(fused.layers[2].moe.down, engine.model.layers[2].moe.down)
    llm = requests["image"]["llm"]
    args = (torch.from_numpy(llm["input_ids"]), torch.from_numpy(llm["embeddings"]),
            torch.from_numpy(llm["mrope_position_ids"]))
    assert torch.equal(prompt_logits(fused, *args), prompt_logits(engine.model, *args))


def test_experts_follow_hf_eager_bfloat16(moe):
    """In bfloat16 the routed experts sum as transformers' eager experts do (each expert's weighted
    output cast to bfloat16, `index_add_` in expert order): bitwise equal on CPU."""
    import copy

    from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextExperts

    hf, engine = moe
    experts = copy.deepcopy(hf.model.model.language_model.layers[1].mlp.experts).to(torch.bfloat16)
    eager = Glm4vMoeTextExperts.forward.__wrapped__  # the class's own loop, under the dispatcher
    x = torch.randn(48, engine.config.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    w, ids = engine.model.layers[1].moe.route(x)
    with torch.no_grad():
        ref = eager(experts, x, ids, w)
        ours = run_experts(x, ids, w, experts.gate_up_proj, experts.down_proj, range(len(experts.gate_up_proj)))
    assert ids.unique().numel() > 2
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, ref)


# ---- the engine against transformers -------------------------------------------------------------

@pytest.mark.parametrize("name", list(PROMPTS))
def test_prefill_logits_match_hf(moe, requests, name):
    hf, engine = moe
    assert_prefill_logits_match(hf.model, engine, requests[name])


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_hf_generate(moe, requests, name):
    """Same tokens as HF generate, every step's logits within 1e-4 of HF's."""
    hf, engine = moe
    req = requests[name]
    expected, logits = hf_greedy_with_logits(hf.model, req, MAX_TOKENS)
    col = submit(engine, req, SamplingParams(max_tokens=MAX_TOKENS), f"greedy-{name}").wait()
    assert_matches_generate(col, engine.eos_token_ids, expected, logits)


def test_concurrent_requests_equal_alone(moe, requests):
    """Greedy and seeded requests of both prompts at once, in a small per-step token budget (prompts
    prefilled in chunks beside other requests' decode steps, so the experts see rows of several
    sequences in one step): each equals its run alone."""
    _, engine = moe
    assert_chunked_concurrent_equal_alone(engine, requests)


# ---- bfloat16 ------------------------------------------------------------------------------------
# transformers' experts implementations (`from_pretrained(experts_implementation=...)`) and the
# tolerance in bfloat16 ulps at the largest logit. The eager loop is what the engine mirrors (each
# expert's weighted output cast to bfloat16, summed by `index_add_` in expert order): measured
# bitwise equal on CPU, every step of both prompts. `grouped_mm`, transformers' default, sums a row's
# top-k expert outputs in float32 and casts once, which rounds differently: measured up to 1.34
# ulps, tokens equal (10 steps compared, as for eager; at 2 ulps the gap rule stops after 5).
EXPERTS_IMPLEMENTATIONS = {"eager": 1, "grouped_mm": 1.5}


@pytest.fixture(scope="module")
def perturbed(ckpt, tmp_path_factory) -> Path:
    """The checkpoint with its language model's norm weights perturbed and its other weights scaled
    by 4 (as tests/test_llm_minicpmv.py: weights of one hide a norm applied on the wrong side of
    its cast)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("glm4v_moe-perturbed")
    shutil.copytree(ckpt, out, dirs_exist_ok=True)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for k, v in tensors.items():
        if "language_model" in k and "norm" in k:
            v.add_(torch.randn(v.shape, generator=gen) * 0.5)
        elif ("language_model" in k or k.startswith("lm_head")) and "e_score_correction_bias" not in k:
            v.mul_(4.0)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def bf16_engine(perturbed):
    engine = Engine(perturbed, dtype="bfloat16", return_logits=True)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("experts", list(EXPERTS_IMPLEMENTATIONS))
def test_bfloat16_matches_hf_bfloat16(perturbed, bf16_engine, experts):
    """Prefill logits, and greedy tokens and logits step by step, within `EXPERTS_IMPLEMENTATIONS`
    ulps of the largest logit of transformers' bfloat16 model (the pattern of
    tests/test_llm_dtype.py: tokens compared until the first step whose top-1 / top-2 gap is within
    twice the tolerance). The router's bias stays float32 on both sides."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(perturbed, dtype=torch.bfloat16,
                                                        experts_implementation=experts).eval()
    assert model.config.text_config._experts_implementation == experts
    assert model.model.language_model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    engine, ulps = bf16_engine, EXPERTS_IMPLEMENTATIONS[experts]
    assert engine.model.layers[1].moe.bias.dtype == torch.float32
    assert engine.model.layers[1].moe.gate_up.dtype == torch.bfloat16
    requests = make_requests(model, AutoProcessor.from_pretrained(perturbed))
    for name, req in requests.items():
        with torch.no_grad():
            ref = model(**req["hf_inputs"]).logits[0, -1].float()
        llm = req["llm"]
        logits = prompt_logits(engine.model, torch.from_numpy(llm["input_ids"]), torch.from_numpy(llm["embeddings"]),
                               torch.from_numpy(llm["mrope_position_ids"]))
        assert float((logits - ref).abs().max()) <= tolerance(ref, ulps), name
    assert greedy_steps_within_tolerance(model, engine, requests, ulps, MAX_TOKENS) >= 8
