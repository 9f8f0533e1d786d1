"""Issue #6's bad-input matrix over gRPC streaming and HTTP generate, with a healthy stream alongside.

Each bad request fails alone with a message naming the input (gRPC streaming carries the message
without the status code; HTTP answers 400), while a streaming request started before them ends
with the same tokens as alone. The preprocess limits are breached over the wire too, each with
the whole message naming the input and the limit, sized from the limits the server reports.
"""
from __future__ import annotations

import io
import json
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from triton_vlm.clients.client import (RequestError, generate, generate_payload, grpc_inputs, http_generate,
                                       request_values)
from triton_vlm.contract.limits import Limits
from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL
from triton_vlm.media import samples

IMG, VID = QWEN2_5_VL.image_placeholder, QWEN2_5_VL.video_placeholder
IMAGE = samples.image_bytes(64, 48)
VIDEO = samples.video_bytes(seconds=1.0, fps=8, width=64, height=48)


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims a size its data does not have: refused before decoding."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    return bytes(data)


# name -> (prompt, images, videos, extra request values, text the message must hold)
CASES = {
    "corrupt image": (IMG + "?", [b"\x89PNG\r\n\x1a\n broken" * 8], [], {}, "images[0]"),
    "truncated mp4": (VID + "?", [], [VIDEO[: len(VIDEO) // 3]], {}, "videos[0]"),
    "decompression bomb": (IMG + "?", [_png_header(30000, 30000)], [], {}, "images[0]"),
    "aspect ratio": (IMG + "?", [samples.image_bytes(600, 2)], [], {}, "images[0]"),
    "more placeholders than media": (IMG + IMG + "?", [IMAGE], [], {}, "text_input"),
    "more media than placeholders": (IMG + "?", [IMAGE, IMAGE], [], {}, "text_input"),
    "empty prompt": ("", [], [], {}, "text_input"),
    "prompt over the context": ("car " * 5000, [], [], {}, "context is 4096"),
    "mm_options not JSON": ("hi", [], [], {"mm_options": "{fps: 2"}, "mm_options"),
    "mm_options unknown key": ("hi", [], [], {"mm_options": {"fsp": 2}}, "mm_options"),
    "mm_options zero fps": (VID + "?", [], [VIDEO], {"mm_options": {"fps": 0}}, "mm_options"),
    "negative temperature": ("hi", [], [], {"temperature": -1.0}, "temperature"),
    "top_p above 1": ("hi", [], [], {"top_p": 2.0}, "top_p"),
    "negative top_k": ("hi", [], [], {"top_k": -3}, "top_k"),
    "zero max_tokens": ("hi", [], [], {"max_tokens": 0}, "max_tokens"),
    "absurd max_tokens": ("hi", [], [], {"max_tokens": 10**9}, "max_tokens"),
}


def _raw(size: int) -> bytes:
    """`size` bytes that are not base64, so the server takes them as they are."""
    return (bytes(range(256)) * (size // 256 + 1))[:size]


def _max_item_bytes(lim: Limits) -> tuple:
    over = lim.max_item_bytes + 1
    return (IMG + "?", [_raw(over)], [], {}, f"images[0]: {over} bytes exceed max_item_bytes={lim.max_item_bytes}")


def _max_request_bytes(lim: Limits) -> tuple:
    n = lim.max_request_bytes // lim.max_item_bytes + 1  # items of the largest size allowed
    return (IMG * n + "?", [_raw(lim.max_item_bytes)] * n, [], {},
            f"images, videos: {n * lim.max_item_bytes} bytes in all exceed max_request_bytes={lim.max_request_bytes}")


def _max_media_items(lim: Limits) -> tuple:
    n = lim.max_media_items + 1
    return (IMG * n + "?", [IMAGE] * n, [], {}, f"images, videos: {n} media items exceed max_media_items={lim.max_media_items}")


def _max_video_frames(lim: Limits) -> tuple:
    n = lim.max_video_frames + 1
    return (VID + "?", [], [VIDEO], {"mm_options": {"num_frames": n}},
            f"mm_options: num_frames={n} exceeds max_frames={lim.max_video_frames}")


def _max_video_source_frames(lim: Limits) -> tuple:
    video = samples.video_bytes(seconds=(lim.max_video_source_frames + 20) / 20, fps=20, width=32, height=32)
    return (VID + "?", [], [video], {}, f"videos[0]: more than max_video_source_frames={lim.max_video_source_frames} frames")


# name -> the case for the server's limits, as in CASES, with the whole message.
LIMIT_CASES = {
    "item over max_item_bytes": _max_item_bytes,
    "request over max_request_bytes": _max_request_bytes,
    "items over max_media_items": _max_media_items,
    "num_frames over max_video_frames": _max_video_frames,
    "video over max_video_source_frames": _max_video_source_frames,
}


@pytest.fixture(scope="module")
def limits(server) -> Limits:
    """The preprocess limits the server runs with (its config parameters; see tests/conftest.py)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    try:
        params = client.get_model_config("preprocess")["parameters"]
    finally:
        client.close()
    return Limits.from_params({name: value["string_value"] for name, value in params.items()})


def _grpc_values(prompt, images, videos, extra) -> dict:
    options = extra.get("mm_options")
    values = request_values(prompt, images, videos, max_tokens=extra.get("max_tokens", 4),
                            temperature=extra.get("temperature"), top_p=extra.get("top_p"), top_k=extra.get("top_k"),
                            mm_options=options if isinstance(options, dict) else None)
    if isinstance(options, str):
        values["mm_options"] = (np.array([options.encode()], np.object_), "BYTES")
    return values


def _stream_error(url: str, values: dict) -> str:
    """Send raw request values over gRPC streaming; the error message the server answers with."""
    import queue

    inputs = grpc_inputs(values)
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            client.async_stream_infer("ensemble", inputs)
            _, error = responses.get(timeout=120)
        finally:
            client.stop_stream()
    assert error is not None, "the request was accepted"
    return error.message() if hasattr(error, "message") else str(error)


@pytest.fixture(scope="module")
def healthy(server):
    """Healthy greedy streams, one after another for as long as the matrix runs: each must end
    with the tokens the same request gives alone."""
    prompt = "<|im_start|>user\n" + IMG + "Describe it.<|im_end|>\n<|im_start|>assistant\n"
    alone = generate(server.grpc_url, prompt, [IMAGE], max_tokens=200).output_ids
    answers: list[list[int]] = []
    done = threading.Event()

    def keep_streaming() -> None:
        while not done.is_set():
            answers.append(generate(server.grpc_url, prompt, [IMAGE], max_tokens=200).output_ids)

    thread = threading.Thread(target=keep_streaming)
    thread.start()
    yield
    done.set()
    thread.join(timeout=300)
    assert answers and all(a == alone for a in answers)  # the first started before any bad request


def _check_grpc(server, prompt, images, videos, extra, named) -> None:
    assert named in _stream_error(server.grpc_url, _grpc_values(prompt, images, videos, extra))


def _check_http(server, prompt, images, videos, extra, named) -> None:
    options = extra.get("mm_options")
    body = generate_payload(prompt, images, videos, max_tokens=extra.get("max_tokens", 4),
                            **{k: v for k, v in extra.items() if k not in ("mm_options", "max_tokens")})
    if options is not None:
        body["mm_options"] = options if isinstance(options, str) else json.dumps(options)
    with pytest.raises(RequestError, match="HTTP 400") as error:
        http_generate(server.http_url, body)
    assert named in str(error.value)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_over_grpc_streaming(server, healthy, case):
    _check_grpc(server, *CASES[case])


@pytest.mark.parametrize("case", CASES)
def test_bad_input_over_http_generate(server, healthy, case):
    _check_http(server, *CASES[case])


@pytest.mark.parametrize("case", LIMIT_CASES)
def test_limit_over_grpc_streaming(server, healthy, limits, case):
    _check_grpc(server, *LIMIT_CASES[case](limits))


@pytest.mark.parametrize("case", LIMIT_CASES)
def test_limit_over_http_generate(server, healthy, limits, case):
    _check_http(server, *LIMIT_CASES[case](limits))


TENSOR_CASES = {
    "missing max_tokens": ({"text_input": (np.array([b"hi"], np.object_), "BYTES")}, "max_tokens"),
    "max_tokens as FP32": ({"text_input": (np.array([b"hi"], np.object_), "BYTES"),
                            "max_tokens": (np.array([4.0], np.float32), "FP32")}, "max_tokens"),
    "text_input of two elements": ({"text_input": (np.array([b"hi", b"there"], np.object_), "BYTES"),
                                    "max_tokens": (np.array([4], np.int32), "INT32")}, "text_input"),
}


@pytest.mark.parametrize("case", TENSOR_CASES)
def test_bad_dtype_and_shape_over_grpc(server, healthy, case):
    values, named = TENSOR_CASES[case]
    assert named in _stream_error(server.grpc_url, values)
