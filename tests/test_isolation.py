"""Issue #23: no client reaches another request's data or the server's controls.

A real tritonserver started as `triton-vlm serve` starts it (supervised, explicit model control),
with an operator's admin key. An outside client, over HTTP and over gRPC with tritonclient, is
refused Triton's shared-memory, model-repository, trace and logging APIs; the ensemble's own steps
share no memory a client could name; the ensemble answers as transformers does before and after
the attempts; the same calls with the key work.
"""
from __future__ import annotations

import json
import mmap
import os
import secrets
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from triton_vlm.clients.client import generate
from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL
from triton_vlm.media import samples
from triton_vlm.server.admin import ADMIN_HEADER, headers

KEY = "operator-" + secrets.token_urlsafe(16)
PROMPT = f"<|im_start|>user\n{QWEN2_5_VL.image_placeholder}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
IMAGE = samples.image_bytes(640, 480)
N = 8


@pytest.fixture(scope="module")
def guarded(lean_repo, tmp_path_factory):
    from tests.servers import running
    from triton_vlm.server.tritonserver import TritonServer

    log = tmp_path_factory.mktemp("isolation") / "tritonserver.log"
    with running(TritonServer(lean_repo, supervise=True, admin_key=KEY, log_file=log)) as server:
        yield server
    assert KEY not in log.read_text()  # the key is never logged


@pytest.fixture(scope="module")
def expected(hf) -> list[int]:
    return hf.generate(hf.inputs(PROMPT, [IMAGE]), N)


def answer(server) -> list[int]:
    return generate(server.grpc_url, PROMPT, [IMAGE], [], max_tokens=N, stream=True).output_ids


def http_call(server, method: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, str]:
    headers = {ADMIN_HEADER: key} if key else {}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


# Every admin call of the issue, raw over HTTP: (method, path, body).
HTTP_ADMIN = [
    ("GET", "/v2/systemsharedmemory/status", None),
    ("POST", "/v2/systemsharedmemory/region/stolen/register", {"key": "/stolen", "offset": 0, "byte_size": 64}),
    ("POST", "/v2/systemsharedmemory/region/stolen/unregister", {}),
    ("POST", "/v2/systemsharedmemory/unregister", {}),
    ("GET", "/v2/cudasharedmemory/status", None),
    ("POST", "/v2/repository/index", {}),
    ("POST", "/v2/repository/models/llm/unload", {}),
    ("POST", "/v2/repository/models/llm/load", {}),
    ("GET", "/v2/trace/setting", None),
    ("POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
    ("GET", "/v2/logging", None),
    ("POST", "/v2/logging", {"log_verbose_level": 1}),
]


def grpc_admin_calls(client) -> dict:
    """Every admin call of the issue through tritonclient gRPC."""
    return {
        "shared memory status": lambda: client.get_system_shared_memory_status(),
        "register shared memory": lambda: client.register_system_shared_memory("stolen", "/stolen", 64),
        "unregister shared memory": lambda: client.unregister_system_shared_memory("stolen"),
        "unregister all shared memory": lambda: client.unregister_system_shared_memory(),
        "repository index": lambda: client.get_model_repository_index(),
        "unload llm": lambda: client.unload_model("llm"),
        "load llm": lambda: client.load_model("llm"),
        "trace settings": lambda: client.get_trace_settings(),
        "update trace settings": lambda: client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}),
        "log settings": lambda: client.get_log_settings(),
        "update log settings": lambda: client.update_log_settings({"log_verbose_level": 1}),
    }


def test_an_outside_client_is_refused_every_admin_api_and_the_ensemble_answers_throughout(guarded, expected):
    assert answer(guarded) == expected
    for method, path, body in HTTP_ADMIN:
        status, text = http_call(guarded, method, path, body)
        assert status == 403 and ADMIN_HEADER in text, (method, path, status, text)
        status, text = http_call(guarded, method, path, body, key="wrong-" + KEY)
        assert status == 403, (method, path, status, text)
    with httpclient.InferenceServerClient(guarded.http_url) as client:
        for name, call in {"status": client.get_system_shared_memory_status,
                           "unload": lambda: client.unload_model("llm"),
                           "index": client.get_model_repository_index}.items():
            with pytest.raises(InferenceServerException, match="restricted"):
                call()
    with grpcclient.InferenceServerClient(guarded.grpc_url) as client:
        for name, call in grpc_admin_calls(client).items():
            with pytest.raises(InferenceServerException, match="restricted") as refused:
                call()
            assert ADMIN_HEADER in refused.value.message(), name
        # inference, health, metadata, model config and statistics stay open
        assert client.is_server_ready() and client.is_model_ready("ensemble")
        assert client.get_model_metadata("ensemble").name == "ensemble"
        assert client.get_model_config("llm").config.name == "llm"
        assert client.get_inference_statistics("ensemble").model_stats
    assert answer(guarded) == expected
    assert guarded.events == []  # nothing was unloaded or reloaded


def test_no_request_data_lies_in_memory_a_client_can_name(guarded, expected):
    """The read-through of issue #23 (a client naming the ensemble's shared memory as its own input,
    getting another request's image embeddings) is impossible: the server holds no region of its
    steps, and an inference naming one fails."""
    assert answer(guarded) == expected  # a request went through every step
    status, text = http_call(guarded, "GET", "/v2/systemsharedmemory/status", key=KEY)
    assert status == 200 and json.loads(text) == []
    with grpcclient.InferenceServerClient(guarded.grpc_url) as client:
        regions = client.get_system_shared_memory_status(headers=headers(KEY, grpc=True), as_json=True)
        assert regions.get("regions", {}) == {}
        pixels = grpcclient.InferInput("pixel_values", [1200, 1176], "FP32")
        pixels.set_shared_memory("triton_vlm_region", 1200 * 1176 * 4)
        grid = grpcclient.InferInput("grid_thw", [1, 3], "INT64")
        grid.set_data_from_numpy(np.array([[1, 30, 40]], dtype=np.int64))
        with pytest.raises(InferenceServerException, match="Unable to find shared memory region"):
            client.infer("vision_encoder", [pixels, grid])
    assert answer(guarded) == expected


def test_the_operator_key_opens_the_admin_apis(guarded, expected):
    name, path = f"operator_{secrets.token_hex(8)}", f"/dev/shm/operator_{secrets.token_hex(8)}"
    with open(path, "wb+") as f:
        f.truncate(4096)
        region = mmap.mmap(f.fileno(), 4096)
    try:
        with grpcclient.InferenceServerClient(guarded.grpc_url) as client:
            admin = headers(KEY, grpc=True)
            client.register_system_shared_memory(name, "/" + os.path.basename(path), 4096, headers=admin)
            listed = client.get_system_shared_memory_status(headers=admin, as_json=True)["regions"]
            assert set(listed) == {name}
            client.unregister_system_shared_memory(name, headers=admin)
            assert client.get_system_shared_memory_status(headers=admin, as_json=True).get("regions", {}) == {}
            index = {m["name"] for m in client.get_model_repository_index(headers=admin, as_json=True)["models"]}
            assert {"ensemble", "preprocess", "vision_encoder", "llm"} <= index
            assert client.get_log_settings(headers=admin, as_json=True)["settings"]
            client.get_trace_settings(headers=admin)
            client.unload_model("llm", headers=admin)
            assert not client.is_model_ready("llm")
            client.load_model("llm", headers=admin)
            assert client.is_model_ready("llm")
    finally:
        region.close()
        os.unlink(path)
    status, text = http_call(guarded, "POST", "/v2/repository/index", {}, key=KEY)
    assert status == 200 and "ensemble" in text
    assert answer(guarded) == expected


def test_serve_refuses_an_admin_key_triton_cannot_take():
    from triton_vlm.server.tritonserver import TritonServer

    for bad in ("short", "has:colon-and-is-long-enough", "has,comma-and-is-long-enough", "spaces are not ok at all"):
        with pytest.raises(ValueError, match="admin key must be") as refused:
            TritonServer("/nonexistent", admin_key=bad)
        assert bad not in str(refused.value)


def test_an_operators_reload_of_the_llm_releases_the_old_one(guarded, expected):
    """After the ensemble has streamed from the llm, an unload and load through the admin API
    ends the old llm's stub (the ensemble's streams used to keep the old model, and its memory,
    for good) and the new one answers as transformers does."""
    assert answer(guarded) == expected
    old = {pid for pid, name in guarded.stub_processes().items() if name.startswith("llm_")}
    for action in ("unload", "load"):
        status, text = http_call(guarded, "POST", f"/v2/repository/models/llm/{action}", {}, key=KEY)
        assert status == 200, text
    deadline = time.monotonic() + 60
    while old & set(guarded.stub_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not old & set(guarded.stub_processes())
    assert answer(guarded) == expected
