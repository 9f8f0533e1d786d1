"""GLM end to end: GLM-4.1V, GLM-4.6V-Flash, GLMGA, GLM-OCR and GLM-4.5V (MoE decoder), each behind its
own real tritonserver, checked against transformers in the same run.

For each variant (a tiny demo checkpoint, its configs as `SERVED_AS` says): `preprocess` equals the checkpoint's own processor
(`input_ids` with the video timestamps, `grid_thw` and `pixel_values` rows in prompt order) and
`get_rope_index`, for an image, videos of 4 s, 45 s and 400 s, and a mix; `vision_encoder` equals
the model's `get_image_features` / `get_video_features`; the ensemble's greedy `output_ids` equal
`generate` over gRPC streaming and HTTP generate, alone and with the other prompts in flight at the
same time. transformers' GLM cannot generate from an image
and a video in one prompt (its video mask also selects the image tokens), so the mixed prompt is
checked through `preprocess` only; the engine has no such limit (tests/test_llm_glm.py checks its
logits per step).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.oracle import Oracle
from tests.test_e2e import assert_served_tokens, family_server, grpc_tokens, infer_direct, media_values
from triton_vlm.families.glm4v import GLM4V
from triton_vlm.families.glm4v.processor import BEGIN_VIDEO
from triton_vlm.media import samples

VARIANTS = ("glm4v", "glm46v", "glmga", "glm_ocr", "glm4v_moe")
# Each variant's checkpoint has its configs as transformers' classes write them ("bare") or
# respelled and moved off our writer's values ("varied": GLM-4.6V and GLMGA saying `model_type`
# glm4v, older rope spellings, other pixel budgets and video sampling; tests/config_variants.py).
SERVED_AS = {"glm4v": "bare", "glm46v": "varied", "glmga": "bare", "glm_ocr": "bare", "glm4v_moe": "varied"}
IMG, VID = GLM4V.image_placeholder, GLM4V.video_placeholder
IMAGE_A = samples.image_bytes(300, 200)
IMAGE_B = samples.image_bytes(120, 180, fmt="PNG", seed=1.0)
VIDEO = samples.video_bytes(seconds=4.0, fps=4, width=96, height=64)
NEW_TOKENS = 8


def chat(content: str) -> str:
    return f"[gMASK]<sop><|user|>\n{content}<|assistant|>\n"


PROMPTS = {
    "image": (chat(IMG + "What is in the picture?"), [IMAGE_A], []),
    "video": (chat(VID + "What moves?"), [], [VIDEO]),
    "text": (chat("Tell me about a red car on the road."), [], []),
}
MIXED = (chat(IMG + "and" + VID + "then" + IMG + "compare them."), [IMAGE_A, IMAGE_B], [VIDEO])
# Long videos cross each variant's sampling-rule boundaries (GLM-4.6V: 1 fps past 30 s, 0.5 fps past
# 300 s; GLM-4.1V: max_duration 300 s); small frames and low source rates keep them cheap.
LONG_VIDEOS = {"video_45s": samples.video_bytes(seconds=45.0, fps=4, width=64, height=48),
               "video_400s": samples.video_bytes(seconds=400.0, fps=1, width=64, height=48)}


@pytest.fixture(scope="module", params=VARIANTS)
def glm(request, tmp_path_factory):
    """(variant, running server, oracle) for one variant's tiny checkpoint; the server is stopped after."""
    with family_server(request.param, tmp_path_factory.mktemp(request.param), SERVED_AS[request.param]) as (server, oracle):
        yield request.param, server, oracle


def hf_inputs(oracle: Oracle, prompt, images, videos) -> dict:
    return oracle.inputs(prompt, images, videos, fps=None)  # each variant samples by its own rule


def hf_rows_in_prompt_order(inputs: dict, video_start_id: int) -> tuple[np.ndarray, np.ndarray]:
    """HF keeps image and video rows apart; the contract concatenates them in prompt order. An image
    starts where a run of image tokens (type 1) starts; a video at its `<|begin_of_video|>`."""
    ids, types = inputs["input_ids"][0].numpy(), inputs["mm_token_type_ids"][0].numpy()
    starts = [(i, "video") for i in np.flatnonzero(ids == video_start_id)]
    starts += [(i, "image") for i in np.flatnonzero((types == 1) & (np.roll(types, 1) != 1))]
    grids = {"image": list(inputs.get("image_grid_thw", [])), "video": list(inputs.get("video_grid_thw", []))}
    pixels = {"image": inputs.get("pixel_values"), "video": inputs.get("pixel_values_videos")}
    offsets, rows, grid_rows = {"image": 0, "video": 0}, [], []
    for _, kind in sorted(starts):
        grid = grids[kind].pop(0).numpy()
        n = int(np.prod(grid))
        rows.append(pixels[kind][offsets[kind]:offsets[kind] + n].numpy())
        offsets[kind] += n
        grid_rows.append(grid)
    return np.concatenate(rows), np.stack(grid_rows).astype(np.int64)


@pytest.mark.parametrize("kind", ["image", "video", "mixed", *LONG_VIDEOS])
def test_preprocess_matches_hf_processor(glm, kind):
    _, server, oracle = glm
    if kind in LONG_VIDEOS:
        prompt, images, videos = chat(VID + "What happens?"), [], [LONG_VIDEOS[kind]]
    else:
        prompt, images, videos = MIXED if kind == "mixed" else PROMPTS[kind]
    inputs = hf_inputs(oracle, prompt, images, videos)
    out = infer_direct(server, "preprocess", media_values(prompt, images, videos),
                       ["input_ids", "pixel_values", "grid_thw", "mrope_position_ids", "mrope_position_delta"])
    np.testing.assert_array_equal(out["input_ids"], inputs["input_ids"][0].numpy())
    pixel_values, grid_thw = hf_rows_in_prompt_order(inputs, oracle.processor.tokenizer.convert_tokens_to_ids(BEGIN_VIDEO))
    np.testing.assert_array_equal(out["grid_thw"], grid_thw)
    assert out["pixel_values"].shape == pixel_values.shape
    assert np.abs(out["pixel_values"] - pixel_values).max() <= 1e-4
    positions, delta = oracle.rope_index(inputs)
    np.testing.assert_array_equal(out["mrope_position_ids"], positions)
    assert int(out["mrope_position_delta"][0]) == delta


@pytest.mark.parametrize("kind", ["image", "video"])
def test_vision_encoder_matches_hf_features(glm, kind):
    _, server, oracle = glm
    inputs = hf_inputs(oracle, *PROMPTS[kind])
    key, grid_key = ("pixel_values", "image_grid_thw") if kind == "image" else ("pixel_values_videos", "video_grid_thw")
    pixel_values, grid_thw = inputs[key].numpy(), inputs[grid_key].numpy()
    out = infer_direct(server, "vision_encoder",
                       {"pixel_values": (pixel_values, "FP32"), "grid_thw": (grid_thw, "INT64")}, ["embeddings"])["embeddings"]
    features = getattr(oracle.model.model, f"get_{kind}_features")
    with torch.no_grad():
        reference = torch.cat(features(inputs[key], inputs[grid_key]).pooler_output).numpy()
    assert out.shape == reference.shape
    assert np.abs(out - reference).max() / np.abs(reference).max() <= 1e-4


@pytest.fixture(scope="module")
def expected_tokens(glm) -> dict[str, list[int]]:
    _, _, oracle = glm
    return {kind: oracle.generate(hf_inputs(oracle, *PROMPTS[kind]), NEW_TOKENS) for kind in PROMPTS}


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_tokens_equal_hf_generate(glm, expected_tokens, kind):
    _, server, _ = glm
    assert_served_tokens(server, PROMPTS[kind], expected_tokens[kind], NEW_TOKENS)


def test_concurrent_requests_each_equal_alone(glm, expected_tokens):
    """Every prompt twice, all in flight at once (batched prefill and decode, MoE experts grouped
    over rows of several sequences): each gets the tokens it gets alone, which are `generate`'s."""
    from concurrent.futures import ThreadPoolExecutor

    _, server, _ = glm
    kinds = list(PROMPTS) * 2
    with ThreadPoolExecutor(len(kinds)) as pool:
        results = list(pool.map(lambda kind: grpc_tokens(server, *PROMPTS[kind], NEW_TOKENS), kinds))
    assert results == [expected_tokens[kind] for kind in kinds]
