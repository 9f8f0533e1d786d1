"""The `llm` engine on InternVL's language models, Qwen2 (InternVL3) and Qwen3 (InternVL3.5, q/k
norms) with 1-D RoPE (positions 0..S-1 as three equal `mrope_position_ids` rows, delta 0), against
transformers: prompts from the HF processor, image rows from the HF model's own
`get_image_features`; prefill logits, greedy tokens and every step's logits (within 1e-4) equal
`generate` for text, an image and images beside a video, whole and in chunked prefill.
"""
from __future__ import annotations

import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests.oracle import Oracle, decode_frames
from tests.test_llm import (assert_matches_generate, assert_prefill_logits_match, greedy_in_steps, hf_greedy_with_logits,
                            llm_request)
from triton_vlm.families.internvl.demo import VIT_6B
from triton_vlm.families.internvl.processor import IMAGE_TOKEN as IMG
from triton_vlm.families.internvl.processor import VIDEO_TOKEN as VID
from triton_vlm.llm import DecoderConfig, Engine
from triton_vlm.media import samples

DECODERS = {"qwen2": {}, "qwen3": dict(text_model="qwen3", vision=VIT_6B)}
VIDEO = samples.video_bytes(seconds=1.0, fps=4, width=96, height=64)


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = {
    "text": (chat("describe the red car on the road, then the blue one behind it " * 3), [], []),
    "image": (chat(IMG + "\nwhat is in this image"), [(200, 120)], []),
    "images+video": (chat(f"{IMG}\n{IMG}\n{VID}\nwhich one is red"), [(200, 120), (64, 300)], [VIDEO]),
}
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=list(DECODERS))
def hf(request, tmp_path_factory) -> Oracle:
    from triton_vlm.families.demo import write_demo_checkpoint

    return Oracle(write_demo_checkpoint("internvl", tmp_path_factory.mktemp("internvl"), "tiny",
                                        overrides=DECODERS[request.param]))


@pytest.fixture(scope="module")
def engine(hf):
    eng = Engine(hf.checkpoint, return_logits=True)
    yield eng
    eng.shutdown()


def hf_inputs(oracle: Oracle, prompt: str, sizes: list, videos: list[bytes]) -> dict:
    from PIL import Image

    kwargs = {}
    if sizes:
        kwargs["images"] = [Image.open(io.BytesIO(samples.image_bytes(w, h, seed=float(i)))).convert("RGB")
                            for i, (w, h) in enumerate(sizes)]
    if videos:
        kwargs["videos"] = [decode_frames(v)[0] for v in videos]
    return oracle.processor(text=[prompt], return_tensors="pt", **kwargs)


@pytest.fixture(scope="module")
def requests(hf):
    out = {}
    for name, (prompt, sizes, videos) in PROMPTS.items():
        inputs = hf_inputs(hf, prompt, sizes, videos)
        rows = []
        if "pixel_values" in inputs:
            with torch.no_grad():
                features = hf.model.model.get_image_features(inputs["pixel_values"]).pooler_output
            rows = [features.reshape(-1, features.shape[-1])]
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


def test_an_unknown_text_model_is_refused_by_name(tmp_path):
    import json

    from triton_vlm.families.demo import write_demo_checkpoint

    checkpoint = write_demo_checkpoint("internvl", tmp_path, "tiny")
    config = json.loads((checkpoint / "config.json").read_text())
    config["text_config"]["model_type"] = "llama"
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="internvl: text_config.model_type 'llama' is not supported; supported: "
                                         "qwen2, qwen3"):
        DecoderConfig.from_checkpoint(checkpoint)
