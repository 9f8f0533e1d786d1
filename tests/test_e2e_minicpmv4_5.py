"""Issue #27 end to end: MiniCPM-V 4.5 behind a real tritonserver, served from the official golden
checkpoint (`tests/golden/minicpmv4_5`, its config respelled: `write_golden_variant`; transformers
has no class for it, so the official code's recorded outputs are the oracle): `preprocess` gives
the official input ids, `vision_encoder` the official resampler rows, and the ensemble's greedy
`output_ids` equal the official `generate`'s over gRPC streaming and HTTP generate, alone and
concurrently, for every case: images, text, and the MP4 sent as a client sends it, its packed
frames resampled with their temporal ids. A video request over a limit is INVALID_ARG naming it,
and the server goes on serving."""
from __future__ import annotations

import re

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from tests.minicpmv4_5_golden import CASES, GOLDEN
from tests.servers import LEAN, running
from tests.test_e2e import concurrently, grpc_tokens, http_tokens, infer_direct, media_values


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The golden checkpoint, its config respelled as the official code reads it alike
    (tests/config_variants.py: `dtype`, the keys its classes default left out)."""
    from tests.config_variants import write_golden_variant
    from triton_vlm.repository.build import build_repository
    from triton_vlm.server.tritonserver import TritonServer

    root = tmp_path_factory.mktemp("minicpmv4_5")
    repo = build_repository(write_golden_variant(GOLDEN, root / "checkpoint"), root / "repository", LEAN)
    with running(TritonServer(repo, log_file=root / "tritonserver.log")) as server:
        yield server


CASE_IDS = list(CASES)
PACKED = {"force_packing": CASES["d_video"]["video"]["force_packing"]}  # as the golden run


def request(case: str) -> tuple[str, list[bytes], list[bytes]]:
    """(prompt, images, videos) of a golden case as a client sends it: the video as its MP4 file
    behind one `(<video>./</video>)` marker where the official chat wrote its frames'
    `(<image>./</image>)` lines."""
    c = CASES[case]
    media = [(GOLDEN / m["file"]).read_bytes() for m in c["media"]]
    if case != "d_video":
        return c["prompt"], media, []
    frames = "\n".join(["(<image>./</image>)"] * len(c["video"]["frame_indices"]))
    return c["prompt"].replace(frames, "(<video>./</video>)"), [], media


def options(case: str) -> dict | None:
    return PACKED if case == "d_video" else None


@pytest.mark.parametrize("case", [c for c in CASE_IDS if CASES[c]["media"]])
def test_preprocess_and_vision_encoder_give_the_official_ids_and_rows(server, golden, case):
    out = infer_direct(server, "preprocess", media_values(*request(case), options(case)),
                       ["input_ids", "pixel_values", "grid_thw", "temporal_ids"])
    np.testing.assert_array_equal(out["input_ids"], golden[f"{case}/input_ids"].reshape(-1))
    np.testing.assert_array_equal(np.repeat(out["grid_thw"][:, 1:], out["grid_thw"][:, 0], axis=0),
                                  CASES[case]["tgt_sizes"])
    rows = infer_direct(server, "vision_encoder", {"pixel_values": (out["pixel_values"], "FP32"),
                                                   "grid_thw": (out["grid_thw"], "INT64"),
                                                   "temporal_ids": (out["temporal_ids"], "INT64")},
                        ["embeddings"])["embeddings"]
    expected = golden[f"{case}/vision_embeds"].reshape(rows.shape)
    assert np.abs(rows - expected).max() <= 1e-4


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.parametrize("case", CASE_IDS)
def test_greedy_tokens_equal_the_official_generate(server, case, transport):
    tokens = grpc_tokens if transport == "grpc" else http_tokens
    expected = CASES[case]["greedy_tokens"]
    assert tokens(server, *request(case), max_tokens=len(expected), mm_options=options(case)) == expected


@pytest.mark.parametrize("case", CASE_IDS)
def test_served_log_probs_are_the_official_logits(server, golden, case):
    """The served model's own log-softmax of each greedy token (`return_log_probs`, HTTP generate)
    against the official logits' (`greedy_logits`), within the issue's 1e-3."""
    from triton_vlm.clients.client import generate_payload, http_generate

    expected = CASES[case]["greedy_tokens"]
    (answer,) = http_generate(server.http_url, generate_payload(*request(case), options(case), max_tokens=len(expected),
                                                                return_log_probs=True))
    assert [int(i) for i in np.atleast_1d(answer["output_ids"])] == expected
    logits = golden[f"{case}/greedy_logits"].astype(np.float64)
    official = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    np.testing.assert_allclose(np.ravel(answer["output_log_probs"]), official[np.arange(len(expected)), expected],
                               atol=1e-3, rtol=0)


def test_concurrent_requests_each_get_the_official_answer(server):
    answers = concurrently(lambda case: grpc_tokens(server, *request(case), max_tokens=8, mm_options=options(case)),
                           CASE_IDS)
    assert answers == {case: CASES[case]["greedy_tokens"] for case in CASE_IDS}


@pytest.mark.parametrize("mm_options, refusal", [
    ({"max_frames": 10_000}, r"^mm_options: max_frames=10000 exceeds max_frames=768$"),
    ({"num_frames": 4}, r"^videos\[0\]: num_frames: MiniCPM-V 4.5 chooses frames by fps"),
])
def test_a_video_over_a_limit_is_invalid_arg_and_the_server_keeps_serving(server, mm_options, refusal):
    from triton_vlm.clients.client import RequestError

    with pytest.raises(RequestError, match=refusal):  # (a gRPC stream carries the message alone)
        grpc_tokens(server, *request("d_video"), max_tokens=4, mm_options=mm_options)
    with pytest.raises(InferenceServerException) as direct:
        infer_direct(server, "preprocess", media_values(*request("d_video"), mm_options), ["input_ids"])
    assert direct.value.status() == "StatusCode.INVALID_ARGUMENT" and re.match(refusal, direct.value.message())
    assert grpc_tokens(server, *request("d_video"), max_tokens=8, mm_options=PACKED) == CASES["d_video"]["greedy_tokens"]
