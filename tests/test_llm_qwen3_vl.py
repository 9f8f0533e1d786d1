"""The `llm` engine on Qwen3-VL's decoder (`qwen3_vl_text`: Qwen3 layers, interleaved M-RoPE,
DeepStack) and Qwen3-VL-MoE's (softmax-routed experts), against transformers as the oracle (tiny
random checkpoint of each, CPU).

Inputs come from the checkpoint's HF processor; vision rows from the HF model's own
`get_image_features` / `get_video_features`, each row the merger's output followed by its DeepStack
maps (the contract's `embedding_width`); positions from `get_rope_index`. The engine gets those
rows and positions, transformers `generate` the same processor inputs. DeepStack maps are added at
the right rows when a prompt is prefilled in chunks of a few tokens (vision runs cut across chunks)
and when part of it comes from the prefix cache (blocks ending inside a vision run); a request
without media carries none.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.oracle import Oracle, feature_rows
from tests.test_llm import (Collector, assert_chunked_concurrent_equal_alone, assert_matches_generate,
                            assert_prefill_logits_match, greedy_in_steps, hf_greedy_with_logits, llm_request, submit)
from triton_vlm.errors import InvalidInput
from triton_vlm.llm import DecoderConfig, Engine, SamplingParams
from triton_vlm.llm.layers.moe import MoeConfig, softmax_route

IMG, VID = "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
PROMPTS = {
    "text": "describe the red car on the road",
    "image": IMG + "what is in this image",
    "two images": IMG + "and" + IMG + "which is larger",
    "video": VID + "what is moving in the video",
    "image+video": IMG + "then" + VID + "compare them",
}
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=("qwen3_vl", "qwen3_vl_moe"))
def qwen3(request, tmp_path_factory):
    """One variant: its checkpoint, the HF oracle, one engine (per-step logits on)."""
    from triton_vlm.families.demo import write_demo_checkpoint

    ckpt = write_demo_checkpoint(request.param, tmp_path_factory.mktemp(f"{request.param}-tiny"), "tiny")
    engine = Engine(ckpt, return_logits=True)
    yield Oracle(ckpt), engine
    engine.shutdown()


def vision_rows(model, pixel_values, grid_thw, video: bool) -> list[torch.Tensor]:
    """Per item: its rows, the merger's output then each DeepStack map (HF's own features)."""
    return feature_rows((model.model.get_video_features if video else model.model.get_image_features)(
        pixel_values, grid_thw))


@pytest.fixture(scope="module")
def requests(qwen3):
    """Per prompt: HF processor inputs and the `llm` inputs made from them (media in prompt order:
    images before videos in every prompt here)."""
    from PIL import Image
    from transformers.video_utils import VideoMetadata

    hf, _ = qwen3
    model, rng = hf.model, np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (160, 192, 3), dtype=np.uint8)),  # 30 merged tokens
              Image.fromarray(rng.integers(0, 256, (64, 160, 3), dtype=np.uint8))]
    video = rng.integers(0, 256, (20, 64, 64, 3), dtype=np.uint8)  # 2 s at 10 fps
    video_kwargs = dict(videos=[video], do_sample_frames=True,
                        video_metadata=[VideoMetadata(total_num_frames=20, fps=10, width=64, height=64)])
    media = {"text": {}, "image": dict(images=images[:1]), "two images": dict(images=images),
             "video": video_kwargs, "image+video": dict(images=images[:1], **video_kwargs)}
    out = {}
    for name, text in PROMPTS.items():
        inputs = hf.processor(text=[f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"],
                              return_tensors="pt", **media[name])
        with torch.no_grad():
            rows = []
            if "pixel_values" in inputs:
                rows += vision_rows(model, inputs["pixel_values"], inputs["image_grid_thw"], False)
            if "pixel_values_videos" in inputs:
                rows += vision_rows(model, inputs["pixel_values_videos"], inputs["video_grid_thw"], True)
            pos, delta = model.model.get_rope_index(
                inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                image_grid_thw=inputs.get("image_grid_thw"), video_grid_thw=inputs.get("video_grid_thw"))
        assert bool(rows) == (name != "text")
        out[name] = llm_request(model, inputs, rows, pos, delta)
    return out


@pytest.fixture(scope="module")
def expected(qwen3, requests):
    """HF greedy tokens and per-step logits of every prompt."""
    hf, _ = qwen3
    return {name: hf_greedy_with_logits(hf.model, req, MAX_TOKENS) for name, req in requests.items()}


def test_config_read_from_checkpoint(qwen3):
    hf, engine = qwen3
    c, cfg = engine.config, hf.model.config
    text = cfg.text_config
    assert c.family == cfg.model_type and c.mrope_interleaved
    assert c.head_dim == text.head_dim == 16 and c.rotary_dim == 16
    assert c.mrope_section == tuple(text.rope_parameters["mrope_section"])
    assert c.placeholder_token_ids == (cfg.image_token_id, cfg.video_token_id)
    assert c.deepstack_maps == len(cfg.vision_config.deepstack_visual_indexes) == 2
    assert c.embedding_width == 3 * text.hidden_size
    if cfg.model_type == "qwen3_vl_moe":
        assert c.moe == MoeConfig(num_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
                                  routed_scaling_factor=1.0, moe_intermediate_size=32, n_shared_experts=0,
                                  first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=(1,))
        assert c.moe_layers == (True, False, True)
        assert [hasattr(layer, "moe") for layer in engine.model.layers] == [True, False, True]
    else:
        assert c.moe is None
    assert DecoderConfig.from_checkpoint(hf.checkpoint) == c


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prefill_logits_match_hf(qwen3, requests, name):
    hf, engine = qwen3
    assert_prefill_logits_match(hf.model, engine, requests[name])


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_hf_generate(qwen3, requests, expected, name):
    """Same tokens as HF generate, every step's logits within 1e-4 of HF's."""
    _, engine = qwen3
    col = submit(engine, requests[name], SamplingParams(max_tokens=MAX_TOKENS), f"greedy-{name}").wait()
    assert_matches_generate(col, engine.eos_token_ids, *expected[name])


def test_deepstack_changes_the_answer(qwen3, requests):
    """The maps are really added: the same prompt with its maps zeroed gives other logits."""
    _, engine = qwen3
    llm = requests["image"]["llm"]
    hidden = engine.config.hidden_size
    bare = dict(llm, embeddings=np.concatenate([llm["embeddings"][:, :hidden],
                                                np.zeros_like(llm["embeddings"][:, hidden:])], axis=1))
    a = submit(engine, {"llm": llm}, SamplingParams(max_tokens=1), "with-maps").wait()
    b = submit(engine, {"llm": bare}, SamplingParams(max_tokens=1), "without-maps").wait()
    assert (a.outputs[0].logits - b.outputs[0].logits).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["image", "image+video"])
def test_prompt_in_chunks_matches_hf(qwen3, requests, expected, name):
    """Prefilled 7 tokens a step (vision runs cut across steps): each chunk adds the maps of its own
    vision rows, and the answer is still `generate`'s."""
    hf, engine = qwen3
    col, steps = greedy_in_steps(engine, hf.checkpoint, requests[name], f"chunks-{name}", MAX_TOKENS, budget=7)
    assert steps > int(requests[name]["llm"]["input_ids"].size) // 7
    assert_matches_generate(col, engine.eos_token_ids, *expected[name])


def test_prefix_cache_hit_matches_hf(qwen3, requests, expected):
    """The second run of a prompt takes its full blocks (8 tokens) from the prefix cache and
    prefills the rest, adding the maps of the rows it runs: `generate`'s answer."""
    hf, engine = qwen3
    eng = Engine(hf.checkpoint, model=engine.model, kv_cache_tokens=2048, block_size=8, prefix_caching=True,
                 return_logits=True)
    try:
        for name in ("image", "image+video"):
            params = SamplingParams(max_tokens=MAX_TOKENS)
            miss = submit(eng, requests[name], params, f"miss-{name}").wait()
            hits = eng.blocks.hits
            hit = submit(eng, requests[name], params, f"hit-{name}").wait()
            assert eng.blocks.hits > hits
            for col in (miss, hit):
                assert_matches_generate(col, eng.eos_token_ids, *expected[name])
    finally:
        eng.shutdown()


def test_prefix_cache_hit_ending_inside_the_image(qwen3, requests, expected):
    """A prompt whose cached prefix ends inside its image run (a first request held the prompt up
    to there): the rest of the image's rows are prefilled with their own maps, the cached ones'
    maps are in the cached K/V; the answer is `generate`'s."""
    hf, engine = qwen3
    llm = requests["image"]["llm"]
    ids, rows = llm["input_ids"], llm["embeddings"]
    vision = np.flatnonzero(np.isin(ids, engine.config.placeholder_token_ids))
    cut = (int(vision[0]) // 8 + 2) * 8  # two blocks past the image's first row, still inside it
    assert vision[0] < cut - 8 and cut + 8 < vision[-1]
    head = cut + 3  # its full blocks end at `cut`
    first = dict(llm, input_ids=ids[:head], embeddings=rows[:int(np.isin(ids[:head], ids[vision]).sum())],
                 mrope_position_ids=llm["mrope_position_ids"][:, :head])
    eng = Engine(hf.checkpoint, model=engine.model, kv_cache_tokens=2048, block_size=8, prefix_caching=True,
                 return_logits=True)
    try:
        submit(eng, {"llm": first}, SamplingParams(max_tokens=1), "head").wait()
        hits = eng.blocks.hits
        col = submit(eng, requests["image"], SamplingParams(max_tokens=MAX_TOKENS), "whole").wait()
        assert (eng.blocks.hits - hits) * 8 == cut  # reused up to inside the image
        assert_matches_generate(col, eng.eos_token_ids, *expected["image"])
    finally:
        eng.shutdown()


def test_text_request_carries_no_maps(qwen3, requests, monkeypatch):
    """A prompt without media pays nothing for DeepStack: its steps carry no maps; a prompt with
    media carries them in its prefill steps only."""
    _, engine = qwen3
    seen: list[tuple[int, bool]] = []
    forward = engine.model.forward

    def spy(batch, attention, states):
        seen.append((int(batch.h.shape[0]), batch.deepstack is not None))
        return forward(batch, attention, states)

    monkeypatch.setattr(engine.model, "forward", spy)
    submit(engine, requests["text"], SamplingParams(max_tokens=3), "text-maps").wait()
    assert seen and not any(maps for _, maps in seen)
    seen.clear()
    submit(engine, requests["image"], SamplingParams(max_tokens=3), "image-maps").wait()
    assert [maps for _, maps in seen] == [True, False, False]


def test_embeddings_of_the_wrong_width_are_refused(qwen3, requests):
    _, engine = qwen3
    llm = requests["image"]["llm"]
    narrow = dict(llm, embeddings=llm["embeddings"][:, :engine.config.hidden_size])
    with pytest.raises(InvalidInput, match=rf"embeddings: shape .*expected \[\d+, {engine.config.embedding_width}\]"):
        engine.submit("narrow", **narrow, params=SamplingParams(max_tokens=2), emit=Collector())


def test_concurrent_requests_equal_alone(qwen3, requests):
    _, engine = qwen3
    assert_chunked_concurrent_equal_alone(engine, {k: requests[k] for k in ("text", "image", "image+video")})


def test_router_matches_hf(qwen3):
    """Qwen3-VL-MoE's softmax router: expert ids and weights equal `Qwen3VLMoeTextTopKRouter`'s (the
    dense variant has none)."""
    hf, engine = qwen3
    assert any(hasattr(layer, "moe") for layer in engine.model.layers) == (engine.config.moe is not None)
    x = torch.randn(257, engine.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for i, layer in enumerate(engine.model.layers):
        if hasattr(layer, "moe"):
            with torch.no_grad():
                _, ref_w, ref_ids = hf.model.model.language_model.layers[i].mlp.gate(x)
            w, ids = softmax_route(x, layer.moe.router, engine.config.moe.num_experts_per_tok)
            assert torch.equal(ids, ref_ids) and torch.allclose(w, ref_w, atol=1e-6, rtol=0)
            assert torch.allclose(w.sum(-1), torch.ones(len(x)))
