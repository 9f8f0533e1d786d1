"""The `llm` engine on the GLM-4 decoder (`glm4v_text`) of GLM-4.1V, GLM-4.6V-Flash and GLMGA, and on
GLM-OCR's (the same without q/k/v biases), against transformers as the oracle (tiny random
checkpoint of each variant, CPU).

Inputs come from the variant's HF processor; vision rows from the HF model's own
`get_image_features` / `get_video_features`; positions from its `get_rope_index`. The engine gets
those rows and positions, transformers `generate` gets the same processor inputs.
(transformers' GLM cannot take an image and a video in one prompt: it masks video frames as image
tokens, so image rows would be scattered over the frames too.)
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.oracle import Oracle
from tests.test_llm import (assert_chunked_concurrent_equal_alone, assert_matches_generate,
                             assert_prefill_logits_match,
                             hf_greedy_with_logits, llm_request, submit)
from triton_vlm.llm import DecoderConfig, Engine, SamplingParams

VARIANTS = ("glm4v", "glm46v", "glmga", "glm_ocr")
PROMPTS = {
    "text": "describe the red car on the road",
    "image": "<|begin_of_image|><|image|><|end_of_image|>what is in this image",
    "video": "<|begin_of_video|><|video|><|end_of_video|>what is moving in the video",
}
MAX_TOKENS = 16


@pytest.fixture(scope="module", params=VARIANTS)
def glm(request, tmp_path_factory):
    """One variant: its checkpoint, the HF oracle, one engine (per-step logits on)."""
    from triton_vlm.families.demo import write_demo_checkpoint

    ckpt = write_demo_checkpoint(request.param, tmp_path_factory.mktemp(f"{request.param}-tiny"), "tiny")
    engine = Engine(ckpt, return_logits=True)
    yield Oracle(ckpt), engine
    engine.shutdown()


@pytest.fixture(scope="module")
def requests(glm):
    """Per prompt: HF processor inputs and the `llm` inputs made from them."""
    from PIL import Image
    from transformers.video_utils import VideoMetadata

    hf, _ = glm
    model, rng = hf.model, np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    video = rng.integers(0, 256, (20, 56, 56, 3), dtype=np.uint8)  # 2 s at 10 fps
    media = {
        "text": {},
        "image": dict(images=[image]),
        "video": dict(videos=[video], do_sample_frames=True,
                      video_metadata=[VideoMetadata(total_num_frames=20, fps=10, width=56, height=56)]),
    }
    out = {}
    for name, text in PROMPTS.items():
        inputs = hf.processor(text=[f"[gMASK]<sop><|user|>\n{text}<|assistant|>\n"], return_tensors="pt",
                              **media[name])
        with torch.no_grad():
            rows = []
            if "pixel_values" in inputs:
                rows += model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
            if "pixel_values_videos" in inputs:
                rows += model.model.get_video_features(inputs["pixel_values_videos"],
                                                       inputs["video_grid_thw"]).pooler_output
            pos, delta = model.model.get_rope_index(
                inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                image_grid_thw=inputs.get("image_grid_thw"), video_grid_thw=inputs.get("video_grid_thw"))
        assert bool(rows) == (name != "text")
        out[name] = llm_request(model, inputs, rows, pos, delta)
    return out


def test_config_read_from_checkpoint(glm):
    """Sizes, rotary split, placeholder and eos ids as transformers' config says."""
    hf, engine = glm
    c, cfg = engine.config, hf.model.config
    text = cfg.text_config
    assert c.family == cfg.model_type
    assert c.head_dim == text.hidden_size // text.num_attention_heads
    assert c.rotary_dim == int(c.head_dim * text.rope_parameters["partial_rotary_factor"]) < c.head_dim
    assert c.mrope_section == tuple(text.rope_parameters["mrope_section"])
    assert c.placeholder_token_ids == (cfg.image_token_id,)  # video frames are image tokens in GLM
    gen = json.loads((hf.checkpoint / "generation_config.json").read_text())
    assert set(c.eos_token_ids) == set(gen["eos_token_id"]) | set(text.eos_token_id)
    assert DecoderConfig.from_checkpoint(hf.checkpoint) == c


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prefill_logits_match_hf(glm, requests, name):
    hf, engine = glm
    assert_prefill_logits_match(hf.model, engine, requests[name])


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_hf_generate(glm, requests, name):
    """Same tokens as HF generate, and every step's logits within 1e-4 of HF's (the tiny random
    model repeats tokens, so the logits show that each step really computed the same thing)."""
    hf, engine = glm
    req = requests[name]
    expected, logits = hf_greedy_with_logits(hf.model, req, MAX_TOKENS)
    col = submit(engine, req, SamplingParams(max_tokens=MAX_TOKENS), f"greedy-{name}").wait()
    assert_matches_generate(col, engine.eos_token_ids, expected, logits)


def test_concurrent_requests_equal_alone(glm, requests):
    """Greedy and seeded requests of every prompt at once, in a small per-step token budget (prompts
    prefilled in chunks beside other requests' decode steps): each equals its run alone."""
    _, engine = glm
    assert_chunked_concurrent_equal_alone(engine, requests)

