"""Issue #28 end to end: LLaVA behind a real tritonserver (one per checkpoint: a CLIP tower with a
Llama decoder, a SigLIP tower with three feature layers and a Qwen2 decoder; the tiny demo
variants of `tests/test_preprocess_llava.py`, their configs as `SERVED_AS` says), checked against transformers in the same run.

`preprocess` equals `LlavaProcessor` (ids, pixel rows, grids); `vision_encoder` equals
`get_image_features`; the ensemble's greedy `output_ids` equal `generate` for text, one image and
several images, over gRPC streaming and HTTP generate, alone and concurrently; a video is
INVALID_ARG naming the family and the server goes on serving.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from tests.oracle import Oracle
from tests.servers import LEAN, running
from tests.test_e2e import assert_served_tokens, grpc_tokens, infer_direct, media_values, served_concurrently
from tests.test_preprocess_llava import chat, hf_inputs, hf_rows, image, llava_checkpoints  # noqa: F401 (fixture)
from triton_vlm.families.llava.processor import IMAGE_TOKEN as IMG
from triton_vlm.media import samples

NEW_TOKENS = 8
PROMPTS = {
    "image": (chat(IMG + "\nWhat is in the picture?"), [image(640, 480)], []),
    "images": (chat(f"{IMG} and {IMG}\nthen {IMG} which is red?"), [image(640, 480), image(200, 100, 1.0),
                                                                    image(90, 300, 2.0)], []),
    "text": (chat("Tell me about a red car on the road."), [], []),
}


# Each checkpoint's configs as others write them (tests/config_variants.py): "varied" (older rope
# spelling, another feature layer, a CLIP processor config without `do_center_crop`, ...) or
# "bare" (transformers' classes' own output for the sizes).
SERVED_AS = {"clip-llama": "varied", "siglip-qwen2-3layers-default": "bare"}


@pytest.fixture(scope="module", params=list(SERVED_AS))
def served(request, llava_checkpoints, tmp_path_factory):
    """(running server, oracle) for the variant's checkpoint; the server is stopped after."""
    from tests.config_variants import derive_variant
    from triton_vlm.repository.build import build_repository
    from triton_vlm.server.tritonserver import TritonServer

    root = tmp_path_factory.mktemp(f"llava-e2e-{request.param}")
    checkpoint = derive_variant(llava_checkpoints[request.param], "llava", SERVED_AS[request.param], root / "checkpoint")
    repo = build_repository(checkpoint, root / "repository", LEAN)
    with running(TritonServer(repo, log_file=root / "tritonserver.log")) as server:
        yield server, Oracle(checkpoint)


def test_preprocess_matches_llava_processor(served):
    server, oracle = served
    for prompt, images, videos in PROMPTS.values():
        out = infer_direct(server, "preprocess", media_values(prompt, images, videos),
                           ["input_ids", "pixel_values", "grid_thw", "mrope_position_ids", "mrope_position_delta"])
        inputs = hf_inputs(oracle, prompt, images)
        np.testing.assert_array_equal(out["input_ids"], inputs["input_ids"][0].numpy())
        pixels, grid = hf_rows(oracle, inputs)
        np.testing.assert_array_equal(out["grid_thw"].reshape(-1, 3), grid)
        np.testing.assert_array_equal(out["pixel_values"].reshape(pixels.shape), pixels)
        n = inputs["input_ids"].shape[1]
        np.testing.assert_array_equal(out["mrope_position_ids"], np.broadcast_to(np.arange(n), (3, n)))
        assert int(out["mrope_position_delta"][0]) == 0


def test_vision_encoder_matches_get_image_features(served):
    server, oracle = served
    prompt, images, _ = PROMPTS["images"]
    inputs = hf_inputs(oracle, prompt, images)
    pixels, grid = hf_rows(oracle, inputs)
    out = infer_direct(server, "vision_encoder", {"pixel_values": (pixels, "FP32"), "grid_thw": (grid, "INT64")},
                       ["embeddings"])["embeddings"]
    with torch.no_grad():
        ref = torch.cat(list(oracle.model.model.get_image_features(inputs["pixel_values"]).pooler_output)).numpy()
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-4


@pytest.fixture(scope="module")
def expected_tokens(served) -> dict[str, list[int]]:
    _, oracle = served
    return {kind: oracle.generate(hf_inputs(oracle, prompt, images), NEW_TOKENS)
            for kind, (prompt, images, _) in PROMPTS.items()}


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_tokens_equal_hf_generate(served, expected_tokens, kind):
    server, _ = served
    assert_served_tokens(server, PROMPTS[kind], expected_tokens[kind], NEW_TOKENS)


def test_concurrent_requests_each_get_their_own_answer(served, expected_tokens):
    server, _ = served
    assert served_concurrently(server, PROMPTS, NEW_TOKENS) == expected_tokens


def test_a_video_is_invalid_arg_and_the_server_keeps_serving(served, expected_tokens):
    from triton_vlm.clients.client import RequestError

    server, _ = served
    video = samples.video_bytes(seconds=1.0, fps=4, width=64, height=64)
    prompt, refusal = chat("<video>\nWhat moves?"), r"^videos: this model \(llava\) takes no videos"
    with pytest.raises(RequestError, match=refusal):  # (a gRPC stream carries the message alone)
        grpc_tokens(server, prompt, [], [video], NEW_TOKENS)
    with pytest.raises(InferenceServerException) as direct:
        infer_direct(server, "preprocess", media_values(prompt, [], [video]), ["input_ids"])
    assert direct.value.status() == "StatusCode.INVALID_ARGUMENT" and re.match(refusal, direct.value.message())
    assert grpc_tokens(server, *PROMPTS["image"], NEW_TOKENS) == expected_tokens["image"]
