"""Issue #24: a step whose stub dies mid-request. Its requests in flight end with UNAVAILABLE ("the
<step> step restarted; retry") within 5 s instead of hanging, so do those sent while the supervisor
reloads it, later ones are answered as transformers answers them, no KV block stays in use, and the
server stops on SIGTERM within its exit timeout.

One real supervised tritonserver (as `triton-vlm serve` runs it) takes the faults one after another,
each test leaving it serving again; clients stream over gRPC and over HTTP generate_stream in loops
while a step's first stub, the ensemble's or tritonserver itself is killed with SIGKILL.
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from tests.metrics import wait_for
from triton_vlm.clients.client import RequestError, generate, generate_payload, http_generate
from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL
from triton_vlm.media import samples
from triton_vlm.serving.pipeline import restarted

PROMPT = f"<|im_start|>user\n{QWEN2_5_VL.image_placeholder}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
IMAGE = samples.image_bytes(320, 240)
N = 24
HANG_S = 5.0  # the bound on how long a request may outlive its step
RELOAD_LIMIT_S = 90.0  # the supervisor's limit on a reload (and on a start), several times what one takes
RETIRE_S = 15.0  # the supervisor's wait for a reloaded model's old instances: these requests take seconds


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


class Load:
    """Two gRPC streaming clients and one HTTP generate_stream client sending the image request in
    loops, from `__enter__` (which returns once a request is in the llm, so that a kill finds
    requests in flight) to `stop`. Daemons, stopped on the way out of the `with` too: a failed
    check must not leave them looping."""

    def __init__(self, server) -> None:
        self.server, self.outcomes, self.crashed = server, [], []
        self.done, self.streaming = threading.Event(), threading.Event()
        self.clients = [threading.Thread(target=self._loop, args=(t,), daemon=True) for t in ("grpc", "grpc", "http")]

    def _loop(self, transport: str) -> None:
        try:
            while not self.done.is_set():
                self.outcomes.append(one_request(self.server, transport, self.streaming))
                if self.outcomes[-1].error is not None:
                    time.sleep(0.1)  # a client's back-off before it retries
        except BaseException as error:  # a client that raised where it should have reported
            self.crashed.append(error)
            raise

    def __enter__(self) -> Load:
        for client in self.clients:
            client.start()
        while len(self.outcomes) < 3:
            time.sleep(0.05)
        self.streaming.clear()
        assert self.streaming.wait(60)
        return self

    def stop(self) -> list[Outcome]:
        self.done.set()
        for client in self.clients:
            client.join(timeout=60 + HANG_S)
        assert not any(client.is_alive() for client in self.clients), "a request hung"
        assert not self.crashed, self.crashed
        return self.outcomes

    def __exit__(self, *exc) -> None:
        self.done.set()


@dataclass
class Supervised:
    """The module's server and everything its supervisor reported."""
    server: Any
    events: list[str]
    log: Path

    def mark(self) -> tuple[int, int]:
        """Where the events and the log are now (what a test reads from)."""
        return len(self.events), self.log.stat().st_size

    def log_since(self, offset: int) -> str:
        with open(self.log) as log:
            log.seek(offset)
            return log.read()


@contextlib.contextmanager
def supervised_server(repo: Path, log: Path) -> Iterator[Supervised]:
    """A server of `repo` as `triton-vlm serve` runs it; at the end it is stopped as serve stops it
    (SIGTERM), which must take no longer than its exit timeout."""
    from triton_vlm.server.tritonserver import EXIT_TIMEOUT_S, TritonServer

    events: list[str] = []
    server = TritonServer(repo, supervise=True, report=events.append, log_file=log, retire_s=RETIRE_S)
    server.start(timeout=RELOAD_LIMIT_S)  # (a reload may take as long)
    try:
        yield Supervised(server, events, log)
    finally:
        server.forward_signal(signal.SIGTERM)
        asked = time.monotonic()
        server.wait()
        took = time.monotonic() - asked
    assert took <= EXIT_TIMEOUT_S + 1.0, took  # (the kill, then the exit seen)


@pytest.fixture(scope="module")
def supervised(tiny_repo, tmp_path_factory):
    """One supervised server for the module's faults one after another (each test leaves it
    serving again, as its checks show)."""
    with supervised_server(tiny_repo, tmp_path_factory.mktemp("step-faults") / "server.log") as running:
        yield running


def wait_for_event(events: list[str], since: int, *wanted: str, timeout: float = 2 * RELOAD_LIMIT_S
                   ) -> tuple[str, float]:
    """The first of the `wanted` events to come after the first `since`, and when it was seen."""
    deadline = time.monotonic() + timeout
    while not (seen := [e for e in wanted if e in events[since:]]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert seen, "\n".join(events[since:])  # (in full: a report of where the stubs were may be among them)
    return seen[0], time.monotonic()


def check_recovery(outcomes: list[Outcome], killed: float, back: float, expected: list[int]) -> list[Outcome]:
    """Requests in flight at the kill, or sent until the server serves again (`back`), ended
    within HANG_S; those sent after are answered as transformers answers them. The failed ones."""
    failed = [o for o in outcomes if o.error is not None]
    for o in failed:
        assert o.end - max(o.start, killed) <= HANG_S, o
        assert o.start < back + 1.0, o  # the ensemble sees the reload within its watch period
    later = [o for o in outcomes if o.start > back + 1.0]
    assert later and all(o.tokens == expected for o in later), [o for o in later if o.tokens != expected]
    assert all(o.tokens == expected for o in outcomes if o.error is None)
    return failed


def check_restart(events: list[str], reason: str | tuple[str, ...], failed: list[Outcome], killed: float,
                  reloading: bool = False) -> None:
    """The supervisor restarted the server for `reason` (or one of them), taking the stubs the
    kill ended for no deaths (no reload was tried, unless `reloading`: a stub died first); gRPC
    requests in flight got UNAVAILABLE."""
    restarts = [e for e in events if e.endswith(": restarting it")]
    assert restarts and restarts[0].startswith(reason), events
    assert reloading or not any("reloading" in e for e in events[:events.index(restarts[0])]), events
    assert any(o.start < killed < o.end for o in failed), failed
    for o in failed:
        if o.transport == "grpc" and o.start < killed:
            assert "StatusCode.UNAVAILABLE" in o.error, o


@pytest.mark.parametrize("model", ["llm", "preprocess", "vision_encoder", "vision_encoder_batch"])
def test_a_dead_step_ends_its_requests_with_unavailable_and_the_server_recovers(supervised, expected, model):
    server, (since, log_at) = supervised.server, supervised.mark()
    with Load(server) as load:
        victim = next(pid for pid, name in server.stub_processes().items() if name == f"{model}_0_0")
        siblings = {pid for pid, name in server.stub_processes().items() if name.startswith(f"{model}_0_")} - {victim}
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        event, back = wait_for_event(supervised.events, since, f"model {model!r} reloaded", "tritonserver restarted")
        events = supervised.events[since:]
        time.sleep(4.0)
        failed = check_recovery(load.stop(), killed, back, expected)

        if event == "tritonserver restarted":
            # python_backend r24.10's hazards of a killed stub: the server aborts (the stub died
            # holding a mutex of the memory they share: boost lock_exception), or it never starts
            # the model's new instances (their stubs wait for their initialize message): the
            # supervisor restarts the server, at once or once the reload overran its limit.
            if "boost::interprocess::lock_exception" in supervised.log_since(log_at):
                check_restart(events, "tritonserver exited by itself with code -6", failed, killed, reloading=True)
            else:
                restarts = [e for e in events if e.endswith(": restarting it")]
                assert restarts[0].startswith(f"reloading {model!r} did not end within {RELOAD_LIMIT_S:.0f} s"), \
                    "\n".join(events)
            return
        for o in failed:  # in flight at the kill, or sent while the step was being reloaded
            assert restarted(model).message in o.error, o
        if model == "llm":  # every request spends most of its time there
            assert any(o.start < killed < o.end for o in failed), failed
        used = wait_for(server, lambda m: m.get("triton_vlm_llm_kv_blocks:used") == 0)
        assert used["triton_vlm_llm_kv_blocks:used"] == 0
        restarts = wait_for(server, lambda m: True)
        assert restarts.get("triton_vlm_step_restarts_total", 0) >= 1, restarts
        # The supervisor said what died and that it reloaded it, and nothing else: the old
        # instances its reload retired are not reported as deaths. They end with their version;
        # where the dead stub held a request, Triton never unloads that version: the supervisor
        # restarts the server for it (and the next test starts once it has).
        events = supervised.events[since:]
        assert events[0].startswith(f"model instance {model}_0_0 died (stub pid {victim})"), events
        assert events[1] == f"model {model!r} reloaded", events
        ended = f"the old instances of {model!r} ended"
        event, _ = wait_for_event(supervised.events, since + 2, ended, "tritonserver restarted",
                                  timeout=RETIRE_S + RELOAD_LIMIT_S)
        later = supervised.events[since + 2:]
        if event == ended:
            assert later == [ended], later
            assert not siblings & set(server.stub_processes())
            assert f"{model}_0_0" in server.stub_processes().values()
        else:
            assert later[0].startswith(f"the old instances of {model!r} (stub pids") and \
                later[0].endswith("restarting it"), later


@pytest.mark.parametrize("victim", ["ensemble", "tritonserver"])
def test_a_dead_ensemble_or_server_is_restarted_and_its_requests_end_at_once(supervised, expected, victim):
    """No reload ends what Triton holds for a dead `ensemble` stub, and a tritonserver that
    aborts ends everything: the supervisor kills the server (when it is the ensemble) and starts
    it again on the same ports. Requests in flight end at once (gRPC: UNAVAILABLE), so do those
    sent while it restarts, later ones are answered as transformers answers them."""
    server, (since, log_at) = supervised.server, supervised.mark()
    with Load(server) as load:
        first, ports = server.process, (server.http_port, server.grpc_port, server.metrics_port)
        stubs = server.stub_processes()
        pid = first.pid if victim == "tritonserver" else next(p for p, i in stubs.items() if i == "ensemble_0_0")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, back = wait_for_event(supervised.events, since, "tritonserver restarted")
        events = supervised.events[since:]
        time.sleep(4.0)
        failed = check_recovery(load.stop(), killed, back, expected)

        # A killed ensemble stub may also take tritonserver down with it before the supervisor's
        # next look at the stubs (SIGSEGV in python_backend r24.10, seen once in a full run): a
        # restart all the same, with what clients see unchanged.
        reason = (("tritonserver exited by itself with code -9",) if victim == "tritonserver"
                  else (f"model instance ensemble_0_0 died (stub pid {pid})", "tritonserver exited by itself"))
        check_restart(events, reason, failed, killed)
        assert server.process is not first and (server.http_port, server.grpc_port, server.metrics_port) == ports
        assert not set(stubs) & set(server.stub_processes())  # the old stubs went with the old server
