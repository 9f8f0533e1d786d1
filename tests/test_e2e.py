"""Issue #2 end to end: a real tritonserver on the tiny checkpoint, checked against transformers.

Pixel parity is against the torchvision `Qwen2VLImageProcessor` / `Qwen2VLVideoProcessor` the
checkpoint saves. Positions are checked against transformers' `get_rope_index` on media short
enough that it agrees with the reference rule (`max + 1`); the long-video regime, where they
differ, is covered in test_preprocess.py against a port of the reference.
"""
from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.oracle import Oracle
from tests.servers import LEAN, running
from triton_vlm.clients.client import (RequestError, generate, generate_payload, grpc_inputs, http_generate,
                                       request_values)
from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL
from triton_vlm.media import samples

IMG, VID = QWEN2_5_VL.image_placeholder, QWEN2_5_VL.video_placeholder
IMAGE_A = samples.image_bytes(640, 480)            # grid not a multiple of the 112 px window
IMAGE_B = samples.image_bytes(200, 150, fmt="PNG", seed=1.0)
VIDEO = samples.video_bytes(seconds=2.0, fps=10, width=160, height=120)
NEW_TOKENS = 16


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = {
    "image": (chat(IMG + "What is in the picture?"), [IMAGE_A], []),
    "video": (chat(VID + "What moves?"), [], [VIDEO]),
    "image+video+image": (chat(IMG + "first, then " + VID + " and " + IMG + " compare them."), [IMAGE_A, IMAGE_B], [VIDEO]),
    "text": (chat("Tell me about a red car on the road."), [], []),
}


def infer_direct(server, model: str, values: dict, outputs: list[str]) -> dict[str, np.ndarray]:
    """A plain gRPC infer on one (non-decoupled) composing model."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        result = client.infer(model, grpc_inputs(values), outputs=[grpcclient.InferRequestedOutput(o) for o in outputs])
    return {o: result.as_numpy(o) for o in outputs}


def media_values(prompt, images, videos, mm_options: dict | None = None) -> dict:
    return {k: v for k, v in request_values(prompt, images, videos, mm_options).items()
            if k in ("text_input", "images", "videos", "mm_options")}


@contextmanager
def family_server(family: str, root: Path, variant: str) -> Iterator[tuple]:
    """(running server, oracle) on a tiny demo checkpoint of `family` built under `root`, its
    configs as `variant` ("bare", "varied": tests/config_variants.py) says, as other writers'
    checkpoints differ from our writer's; the server is stopped after."""
    from tests.config_variants import write_variant
    from triton_vlm.repository.build import build_repository
    from triton_vlm.server.tritonserver import TritonServer

    checkpoint = write_variant(family, variant, root / "checkpoint")
    repo = build_repository(checkpoint, root / "repository", LEAN)
    with running(TritonServer(repo, log_file=root / "tritonserver.log")) as server:
        yield server, Oracle(checkpoint)


def grpc_tokens(server, prompt, images, videos, max_tokens: int, stream: bool = True,
                mm_options: dict | None = None) -> list[int]:
    """The ensemble's output_ids over gRPC (streamed, or one response)."""
    return generate(server.grpc_url, prompt, images, videos, max_tokens=max_tokens, stream=stream,
                    mm_options=mm_options).output_ids


def http_tokens(server, prompt, images, videos, max_tokens: int, mm_options: dict | None = None) -> list[int]:
    """The ensemble's output_ids over HTTP generate."""
    (answer,) = http_generate(server.http_url, generate_payload(prompt, images, videos, mm_options,
                                                                max_tokens=max_tokens))
    return [int(i) for i in np.atleast_1d(answer["output_ids"])]


def assert_served_tokens(server, request: tuple, expected: list[int], new_tokens: int) -> None:
    """The ensemble's greedy tokens for `request` (prompt, images, videos) are `expected`, over gRPC
    streaming and over HTTP generate."""
    assert grpc_tokens(server, *request, new_tokens) == expected
    assert http_tokens(server, *request, new_tokens) == expected


def served_concurrently(server, requests: dict, new_tokens: int) -> dict:
    """{key: the ensemble's gRPC tokens} for every request of `requests`, all in flight at once."""
    return concurrently(lambda key: grpc_tokens(server, *requests[key], new_tokens), requests)


def concurrently(run: Callable, keys) -> dict:
    """{key: run(key)}, each key in a thread of its own, all started before any is joined."""
    answers: dict = {}
    threads = [threading.Thread(target=lambda k=k: answers.__setitem__(k, run(k))) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return answers


def hf_rows_in_prompt_order(hf_inputs, input_ids: np.ndarray, image_token: int, video_token: int):
    """HF keeps image and video rows apart; the contract concatenates them in prompt order."""
    grids = {"image": list(hf_inputs.get("image_grid_thw", [])), "video": list(hf_inputs.get("video_grid_thw", []))}
    pixels = {"image": hf_inputs.get("pixel_values"), "video": hf_inputs.get("pixel_values_videos")}
    offsets, rows, grid_rows = {"image": 0, "video": 0}, [], []
    starts = [i for i in range(len(input_ids)) if input_ids[i] in (image_token, video_token)
              and (i == 0 or input_ids[i - 1] != input_ids[i])]
    for start in starts:
        kind = "image" if input_ids[start] == image_token else "video"
        grid = grids[kind].pop(0)
        n = int(np.prod(grid.numpy()))
        rows.append(pixels[kind][offsets[kind]:offsets[kind] + n].numpy())
        offsets[kind] += n
        grid_rows.append(grid.numpy())
    if not rows:
        return None, np.zeros((0, 3), np.int64)
    return np.concatenate(rows), np.stack(grid_rows).astype(np.int64)


@pytest.fixture(scope="session")
def expected(hf):
    """HF processor outputs, positions and greedy tokens for each prompt, computed once."""
    table = {}
    for kind, (prompt, images, videos) in PROMPTS.items():
        inputs = hf.inputs(prompt, images, videos)
        positions, delta = hf.rope_index(inputs)
        table[kind] = dict(inputs=inputs, positions=positions, delta=delta,
                           tokens=hf.generate(inputs, NEW_TOKENS))
    return table


@pytest.mark.parametrize("kind", PROMPTS)
def test_preprocess_matches_hf_processor(server, hf, expected, kind):
    prompt, images, videos = PROMPTS[kind]
    assert_preprocess_equals_hf(server, hf, media_values(prompt, images, videos), expected[kind])


def assert_preprocess_equals_hf(server, oracle: Oracle, values: dict, want: dict) -> None:
    """`preprocess` on `values` gives the HF processor's ids, rows and grids (`want["inputs"]`, rows
    in prompt order) and `get_rope_index`'s positions and delta (`want["positions"]`, `want["delta"]`)."""
    out = infer_direct(server, "preprocess", values,
                       ["input_ids", "pixel_values", "grid_thw", "mrope_position_ids", "mrope_position_delta"])
    hf_ids = want["inputs"]["input_ids"][0].numpy()
    np.testing.assert_array_equal(out["input_ids"], hf_ids)
    pixel_values, grid_thw = hf_rows_in_prompt_order(want["inputs"], hf_ids, oracle.processor.image_token_id,
                                                     oracle.processor.video_token_id)
    np.testing.assert_array_equal(out["grid_thw"].reshape(-1, 3), grid_thw)
    if pixel_values is None:
        assert out["pixel_values"].shape[0] == 0
    else:
        assert out["pixel_values"].shape == pixel_values.shape
        assert np.abs(out["pixel_values"] - pixel_values).max() <= 1e-4
    np.testing.assert_array_equal(out["mrope_position_ids"], want["positions"])
    assert int(out["mrope_position_delta"][0]) == want["delta"]


def test_vision_encoder_matches_hf_tower(server, hf):
    """640x480 -> grid [1, 34, 46]: 34 and 46 are not multiples of the 8-patch window."""
    inputs = hf.inputs(chat(IMG), [IMAGE_A])
    pixel_values, grid_thw = inputs["pixel_values"].numpy(), inputs["image_grid_thw"].numpy()
    assert grid_thw[0, 1] % 8 and grid_thw[0, 2] % 8
    out = infer_direct(server, "vision_encoder", {"pixel_values": (pixel_values, "FP32"), "grid_thw": (grid_thw, "INT64")},
                       ["embeddings"])["embeddings"]
    reference = hf.vision(pixel_values, grid_thw)
    assert out.shape == reference.shape
    assert np.abs(out - reference).max() / np.abs(reference).max() <= 1e-4


def _grpc(server, kind, stream):
    return grpc_tokens(server, *PROMPTS[kind], NEW_TOKENS, stream)


TRANSPORTS = {
    "grpc-stream": lambda server, kind: _grpc(server, kind, True),
    "grpc": lambda server, kind: _grpc(server, kind, False),
    "http-generate": lambda server, kind: http_tokens(server, *PROMPTS[kind], NEW_TOKENS),
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", PROMPTS)
def test_greedy_tokens_equal_hf_generate(server, expected, kind, transport):
    assert TRANSPORTS[transport](server, kind) == expected[kind]["tokens"]


def test_streaming_sends_one_response_per_token(server, expected):
    prompt, images, videos = PROMPTS["image"]
    pieces = []
    result = generate(server.grpc_url, prompt, images, videos, max_tokens=NEW_TOKENS, stream=True, on_text=pieces.append)
    assert result.responses == len(result.output_ids) == len(expected["image"]["tokens"])
    assert result.finish_reason in ("length", "stop")
    assert "".join(pieces) == result.text


def test_concurrent_requests_each_get_their_own_answer(server, expected):
    answers = concurrently(lambda kind: _grpc(server, kind, True), PROMPTS)
    assert answers == {k: expected[k]["tokens"] for k in PROMPTS}


BAD_REQUESTS = {
    "corrupt image": ((chat(IMG + "?"), [b"\xff\xd8\xff\xe0 not really a jpeg" * 4], []), "images[0]"),
    "truncated mp4": ((chat(VID + "?"), [], [VIDEO[: len(VIDEO) // 3]]), "videos[0]"),
    "placeholder count": ((chat(IMG + IMG + "?"), [IMAGE_A], []), "text_input"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_input_is_invalid_arg_and_server_keeps_serving(server, expected, case):
    (prompt, images, videos), names = BAD_REQUESTS[case]
    with pytest.raises(RequestError, match=names.replace("[", r"\[").replace("]", r"\]")):
        generate(server.grpc_url, prompt, images, videos, max_tokens=4)
    with pytest.raises(InferenceServerException) as direct:
        infer_direct(server, "preprocess", media_values(prompt, images, videos), ["input_ids"])
    assert direct.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert names in direct.value.message()
    with pytest.raises(RequestError, match="HTTP 400"):
        http_generate(server.http_url, generate_payload(prompt, images, videos, max_tokens=4))
    assert _grpc(server, "text", True) == expected["text"]["tokens"]


def test_media_as_base64_and_data_url_equal_raw_bytes(server):
    prompt, images, _ = PROMPTS["image"]
    raw = infer_direct(server, "preprocess", media_values(prompt, images, []), ["input_ids", "pixel_values"])
    for encoded in (base64.b64encode(IMAGE_A), b"data:image/jpeg;base64," + base64.b64encode(IMAGE_A)):
        out = infer_direct(server, "preprocess", media_values(prompt, [encoded], []), ["input_ids", "pixel_values"])
        np.testing.assert_array_equal(out["input_ids"], raw["input_ids"])
        np.testing.assert_array_equal(out["pixel_values"], raw["pixel_values"])


def test_the_encoder_front_holds_no_torch(server):
    """The `vision_encoder` front's instances (several) only route rows: no torch in them. A front
    that imported its tower held torch in each instance, and its exit was slow enough to leave its
    shared memory behind when the server went."""
    fronts = [pid for pid, name in server.stub_processes().items() if name.startswith("vision_encoder_0_")]
    assert fronts
    for pid in fronts:
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), pid
