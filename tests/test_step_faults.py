"""Issue #24: a step whose stub dies mid-request. Its requests in flight end with UNAVAILABLE ("the
<step> step restarted; retry") within 5 s instead of hanging, so do those sent while the supervisor
reloads it, later ones are answered as transformers answers them, no KV block stays in use, and the
server stops on SIGTERM within its exit timeout and grace.

A real supervised tritonserver (as `triton-vlm serve` runs it) per step; clients stream over gRPC
and over HTTP generate_stream in loops while the step's first stub is killed with SIGKILL.
"""
from __future__ import annotations

import os
import queue
import signal
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from tests.metrics import wait_for
from triton_vlm import samples
from triton_vlm.client import RequestError, generate, generate_payload, http_generate
from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL
from triton_vlm.pipeline import restarted

PROMPT = f"<|im_start|>user\n{QWEN2_5_VL.image_placeholder}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
IMAGE = samples.image_bytes(320, 240)
N = 24
HANG_S = 5.0  # the bound on how long a request may outlive its step


@dataclass
class Outcome:
    transport: str
    start: float
    end: float
    tokens: list[int] | None = None
    error: str | None = None


@pytest.fixture(scope="module")
def expected(hf) -> list[int]:
    return hf.generate(hf.inputs(PROMPT, [IMAGE]), N)


def one_request(server, transport: str, streaming: threading.Event) -> Outcome:
    start = time.monotonic()
    try:
        if transport == "grpc":
            tokens = generate(server.grpc_url, PROMPT, [IMAGE], [], max_tokens=N, stream=True, timeout=60,
                              on_text=lambda text: streaming.set()).output_ids
        else:
            events = http_generate(server.http_url, generate_payload(PROMPT, [IMAGE], max_tokens=N), stream=True,
                                   timeout=60)
            errors = [event["error"] for event in events if "error" in event]
            if errors:
                raise RequestError(errors[0])
            tokens = [int(i) for event in events for i in np.atleast_1d(event.get("output_ids", []))]
        return Outcome(transport, start, time.monotonic(), tokens=tokens)
    except (RequestError, OSError) as error:
        return Outcome(transport, start, time.monotonic(), error=str(error))
    except queue.Empty:
        return Outcome(transport, start, time.monotonic(), error="no answer within 60 s")


@pytest.mark.parametrize("model", ["llm", "preprocess", "vision_encoder", "vision_encoder_batch"])
def test_a_dead_step_ends_its_requests_with_unavailable_and_the_server_recovers(tiny_repo, tmp_path, expected, model):
    from triton_vlm.server import EXIT_TIMEOUT_S, STOP_GRACE_S, TritonServer

    events: list[str] = []
    server = TritonServer(tiny_repo, supervise=True, report=events.append, log_file=tmp_path / "server.log")
    server.start()
    done, streaming = threading.Event(), threading.Event()
    try:
        outcomes: list[Outcome] = []

        def loop(transport: str) -> None:
            while not done.is_set():
                outcomes.append(one_request(server, transport, streaming))
                if outcomes[-1].error is not None:
                    time.sleep(0.1)  # a client's back-off before it retries

        # daemons, and `done` set on the way out: a failed check must not leave them looping
        clients = [threading.Thread(target=loop, args=(t,), daemon=True) for t in ("grpc", "grpc", "http")]
        for client in clients:
            client.start()
        while len(outcomes) < 3:
            time.sleep(0.05)
        streaming.clear()
        assert streaming.wait(60)  # a request is in the llm: the kill finds requests in flight
        victim = next(pid for pid, name in server.stub_processes().items() if name == f"{model}_0_0")
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 120
        while f"model {model!r} reloaded" not in events and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f"model {model!r} reloaded" in events, events
        reloaded = time.monotonic()
        time.sleep(4.0)
        done.set()
        for client in clients:
            client.join(timeout=60 + HANG_S)
        assert not any(client.is_alive() for client in clients), "a request hung"

        failed = [o for o in outcomes if o.error is not None]
        for o in failed:  # in flight at the kill, or sent while the step was being reloaded
            assert restarted(model).message in o.error, o
            assert o.end - max(o.start, killed) <= HANG_S, o
            assert o.start < reloaded + 1.0, o  # the ensemble sees the reload within its watch period
        if model == "llm":  # every request spends most of its time there
            assert any(o.start < killed < o.end for o in failed), outcomes
        later = [o for o in outcomes if o.start > reloaded + 1.0]
        assert later and all(o.tokens == expected for o in later), [o for o in later if o.tokens != expected]
        assert all(o.tokens == expected for o in outcomes if o.error is None)
        used = wait_for(server, lambda m: m.get("triton_vlm_llm_kv_blocks:used") == 0)
        assert used["triton_vlm_llm_kv_blocks:used"] == 0
        restarts = wait_for(server, lambda m: True)
        assert restarts.get("triton_vlm_step_restarts_total", 0) >= 1, restarts
    finally:
        done.set()
        server.forward_signal(signal.SIGTERM)
        asked = time.monotonic()
        server.wait()
        took = time.monotonic() - asked
    assert took <= EXIT_TIMEOUT_S + STOP_GRACE_S + 2, took  # (the kill, then the exit seen)
