"""Issue #27 end to end: MiniCPM-V 4.5 behind a real tritonserver, served from the official golden
checkpoint (`tests/golden/minicpmv4_5`; transformers has no class for it, so the official code's
recorded outputs are the oracle): `preprocess` gives the official input ids, `vision_encoder` the
official resampler rows, and the ensemble's greedy `output_ids` equal the official `generate`'s
over gRPC streaming and HTTP generate, alone and concurrently, for the image and text cases. A
video, not served yet, is INVALID_ARG and the server goes on serving."""
from __future__ import annotations

import re

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from tests.minicpmv4_5_golden import CASES, GOLDEN, IMAGE_CASES
from tests.test_e2e import concurrently, grpc_tokens, http_tokens, infer_direct, media_values


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from triton_vlm.repository import build_repository
    from triton_vlm.server import TritonServer

    root = tmp_path_factory.mktemp("minicpmv4_5")
    repo = build_repository(GOLDEN, root / "repository")
    with TritonServer(repo, log_file=root / "tritonserver.log") as running:
        yield running


def request(case: str) -> tuple[str, list[bytes], list[bytes]]:
    c = CASES[case]
    return c["prompt"], [(GOLDEN / m["file"]).read_bytes() for m in c["media"]], []


@pytest.mark.parametrize("case", [c for c in IMAGE_CASES if CASES[c]["media"]])
def test_preprocess_and_vision_encoder_give_the_official_ids_and_rows(server, golden, case):
    out = infer_direct(server, "preprocess", media_values(*request(case)), ["input_ids", "pixel_values", "grid_thw"])
    np.testing.assert_array_equal(out["input_ids"], golden[f"{case}/input_ids"].reshape(-1))
    np.testing.assert_array_equal(out["grid_thw"][:, 1:], CASES[case]["tgt_sizes"])
    rows = infer_direct(server, "vision_encoder", {"pixel_values": (out["pixel_values"], "FP32"),
                                                   "grid_thw": (out["grid_thw"], "INT64")}, ["embeddings"])["embeddings"]
    expected = golden[f"{case}/vision_embeds"].reshape(rows.shape)
    assert np.abs(rows - expected).max() <= 1e-4


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.parametrize("case", IMAGE_CASES)
def test_greedy_tokens_equal_the_official_generate(server, case, transport):
    tokens = grpc_tokens if transport == "grpc" else http_tokens
    expected = CASES[case]["greedy_tokens"]
    assert tokens(server, *request(case), max_tokens=len(expected)) == expected


def test_concurrent_requests_each_get_the_official_answer(server):
    answers = concurrently(lambda case: grpc_tokens(server, *request(case), max_tokens=8), IMAGE_CASES)
    assert answers == {case: CASES[case]["greedy_tokens"] for case in IMAGE_CASES}


def test_a_video_is_invalid_arg_and_the_server_keeps_serving(server):
    from triton_vlm.client import RequestError

    video = (GOLDEN / CASES["d_video"]["media"][0]["file"]).read_bytes()
    prompt, refusal = "(<video>./</video>)\nDescribe the video.", r"^videos: this model \(minicpmv4_5\) takes no videos"
    with pytest.raises(RequestError, match=refusal):  # (a gRPC stream carries the message alone)
        grpc_tokens(server, prompt, [], [video], max_tokens=4)
    with pytest.raises(InferenceServerException) as direct:
        infer_direct(server, "preprocess", media_values(prompt, [], [video]), ["input_ids"])
    assert direct.value.status() == "StatusCode.INVALID_ARGUMENT" and re.match(refusal, direct.value.message())
    assert grpc_tokens(server, *request("e_text_only"), max_tokens=8) == CASES["e_text_only"]["greedy_tokens"]
