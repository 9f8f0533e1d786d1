"""The `ensemble`'s orchestration, free of Triton: steps run in order, the last one streamed, a
client's cancellation passed on as a `stop` for the request, an in-flight cap.

As tensorrtllm_backend's BLS model splits `Decoder` (the logic) from `TritonDecoder` (the calls),
`Pipeline` takes the calls as functions: `call` runs a step and returns its outputs (or raises
`StepFailed`), `stream` runs the last step and yields its `Reply`s, `stop` asks the last step to end
a request id. Each request's responses go to a `Client` (`send`, `close`, `is_cancelled`).
`triton_vlm.serving.backend.ensemble.PipelineModel` supplies the Triton versions of these; tests supply fakes.
The steps are the contract's (`triton_vlm.contract.tensors.Step`, written into the ensemble's
config by the build). Tensors and errors are opaque here, but for the `Failure`s this module makes
itself.
"""
from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from triton_vlm.contract.tensors import Step
from triton_vlm.errors import REFUSALS, RESTARTED, InvalidInput, busy

log = logging.getLogger("triton_vlm")


@dataclass(frozen=True)
class Failure:
    """An error to answer a request with; `code` is a Triton error code's name (`INVALID_ARG`,
    `UNAVAILABLE`, `CANCELLED`, `INTERNAL`, ...)."""
    code: str
    message: str


# Triton's words for a model whose stub died ("Stub process 'llm_0_0' is not healthy") or that is
# being reloaded after it ("Request for unknown model: 'llm' has no available versions", "Model
# 'llm' is not ready").
STEP_GONE = ("is not healthy", "has no available versions", "Request for unknown model", "' is not ready")


def step_failure(code: str, message: str) -> Failure:
    """A step's error as passed on: a refusal for now, or a step that died and is being reloaded,
    is UNAVAILABLE, so the client may retry."""
    if (code == "INTERNAL" and any(m in message for m in REFUSALS)) or any(m in message for m in STEP_GONE):
        code = "UNAVAILABLE"
    return Failure(code, message)


def restarted(model: str) -> Failure:
    """What a request gets when a step it needs died under it or is being reloaded."""
    return Failure("UNAVAILABLE", f"the {model} {RESTARTED}")


def gone(model: str, error: Any) -> Any:
    """`error`, or `restarted(model)` where it says that the step is gone (Triton's words are
    internals to a client)."""
    if isinstance(error, Failure) and any(m in error.message for m in STEP_GONE):
        return restarted(model)
    return error


class StepFailed(Exception):
    """Raised by `call` when a step answered with an error; the request ends with `error`."""

    def __init__(self, error: Any) -> None:
        super().__init__(error)
        self.error = error


@dataclass(frozen=True)
class Reply:
    """One response of the last step: outputs (passed on as they are; `final` when it ends the
    request), or an error, or neither (a bare final flag)."""
    outputs: Any = None
    final: bool = False
    error: Any = None


class Client(Protocol):
    """The requester's side of one request."""

    def send(self, outputs: Any, final: bool) -> None:
        """A response with outputs; `final`: it is the last."""

    def close(self, error: Any = None) -> None:
        """The last response: the error, or only the final flag."""

    def is_cancelled(self) -> bool:
        """Whether the client cancelled the request or went away."""


class Pipeline:
    """Runs each request on a thread of its own (at most `max_inflight` at once; beyond that a
    request is refused at once with UNAVAILABLE) through `steps`.

    `check(inputs)` (raising InvalidInput) refuses a request before any step runs. Middle steps run
    one after the other; an error ends the request with it. The last step streams; its replies go
    to the client as they come. One watcher thread polls the clients whose last step is running
    every `poll_s` and sends `stop(request_id)` once for each that is cancelled (Triton 2.51 does
    not tell a running step that its caller's client went away). A cancelled request whose last
    step has not started ends with CANCELLED without starting it. Each client gets exactly one
    final response and is not touched after it.
    """

    def __init__(self, steps: Sequence[Step], *, call: Callable[[Step, dict[str, Any], str], Mapping[str, Any]],
                 stream: Callable[[Step, dict[str, Any], str], Iterable[Reply]], stop: Callable[[str], None],
                 max_inflight: int, check: Callable[[Mapping[str, Any]], None] = lambda inputs: None,
                 is_empty: Callable[[Any], bool] = lambda tensor: tensor.size == 0, poll_s: float = 0.02) -> None:
        if not steps:
            raise ValueError("a pipeline needs at least one step")
        self.steps = list(steps)
        self.max_inflight = max_inflight
        self._call, self._stream, self._stop, self._check, self._is_empty = call, stream, stop, check, is_empty
        self._flights: dict[str, _Flight] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, args=(poll_s,), name="pipeline-cancel", daemon=True)
        self._watcher.start()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._flights)

    def submit(self, inputs: dict[str, Any], client: Client, request_id: str = "") -> None:
        """Start a request, or refuse it at once. Its id for the steps is `request_id` (or "request")
        and 128 random bits: a `stop` names a request by its id, so no client may guess another's."""
        with self._lock:
            if len(self._flights) >= self.max_inflight:
                refused = Failure("UNAVAILABLE", busy(f"{len(self._flights)} requests in flight, "
                                                      f"max_inflight_requests={self.max_inflight}"))
            else:
                refused = None
                request_id = f"{request_id or 'request'}-{secrets.token_hex(16)}"
                self._flights[request_id] = flight = _Flight(client, lambda: self._release(request_id))
        if refused is not None:
            client.close(refused)
            return
        # Daemon threads (at most max_inflight): nothing joins a thread that waits on a step at exit.
        threading.Thread(target=self._run, args=(request_id, flight, dict(inputs)), name=f"pipeline-{request_id}",
                         daemon=True).start()

    def _run(self, request_id: str, flight: _Flight, tensors: dict[str, Any]) -> None:
        try:
            try:
                self._check(tensors)
            except InvalidInput as error:
                flight.finish(Failure("INVALID_ARG", str(error)))
                return
            for i, step in enumerate(self.steps):
                if flight.is_cancelled():
                    flight.finish(Failure("CANCELLED", "cancelled"))
                    return
                given = {n: tensors[n] for n in step.inputs if n in tensors}
                skipped = given.get(step.skip_when_empty)
                if skipped is not None and self._is_empty(skipped):
                    continue
                flight.step = step
                if i < len(self.steps) - 1:
                    try:
                        tensors.update(self._call(step, given, request_id))
                    except StepFailed as failed:
                        flight.finish(gone(step.model, failed.error))
                        return
                    if flight.done:  # ended by `abort` while the step ran
                        return
                    continue
                flight.last_started = True
                for reply in self._stream(step, given, request_id):
                    if flight.done:
                        continue  # drain to the last step's own final response
                    if reply.error is not None:
                        flight.finish(gone(step.model, reply.error))
                    elif reply.outputs is not None:
                        flight.send(reply.outputs, reply.final)
            flight.finish()
        except Exception:
            log.exception("pipeline request %s failed", request_id)
            flight.finish(Failure("INTERNAL", "internal error in the ensemble; see the server log"))
        finally:
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        """The request's place among those in flight is free: its final response is about to go
        (a client that sends its next request on seeing it must find the place free), or its
        thread ended."""
        with self._lock:
            self._flights.pop(request_id, None)

    def abort(self, model: str, error: Any) -> int:
        """End now, with `error`, every request whose running step is `model` or calls it (its
        stub died: the call would wait for the model's reload); returns how many. Their threads
        drop what the step gives later. A step is marked running before it is called, so a
        request reaching it after this is one that `call` or `stream` can refuse by itself."""
        with self._lock:
            flights = [f for f in self._flights.values() if f.step is not None
                       and model in (f.step.model, *f.step.calls)]
        for flight in flights:
            flight.finish(error)
        return len(flights)

    def _watch(self, poll_s: float) -> None:
        while not self._closing.wait(poll_s):
            self._poll()

    def _poll(self) -> None:
        """One look at the running requests. Its own call, so that no reference to a client
        outlives it: a loop variable left bound in `_watch` kept the last polled client (in Triton,
        its response sender) alive until the stub's teardown, where freeing it crashed the stub."""
        with self._lock:
            flights = [(rid, f) for rid, f in self._flights.items() if f.last_started and not f.stop_sent]
        for request_id, flight in flights:
            try:
                if flight.is_cancelled():
                    flight.stop_sent = True
                    self._stop(request_id)
            except Exception:
                log.exception("stopping request %s failed", request_id)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the watcher and wait for it (requests in flight go on)."""
        self._closing.set()
        self._watcher.join(timeout)


class _Flight:
    """One request in flight. Its client must not be touched once the final response is out (in
    Triton the request is released then: a later `is_cancelled()` reads freed memory), so sending
    and polling go through one lock and stop at `done`. `release` is called once, just before the
    final response goes."""

    def __init__(self, client: Client, release: Callable[[], None]) -> None:
        self._client = client
        self._release = release
        self._lock = threading.Lock()
        self.done = False
        self.step: Step | None = None  # the step running (or about to)
        self.last_started = False
        self.stop_sent = False

    def send(self, outputs: Any, final: bool) -> None:
        with self._lock:
            if not self.done:
                if final:
                    self.done = True
                    self._release()
                self._client.send(outputs, final)

    def finish(self, error: Any = None) -> None:
        """The final response (the error, or the final flag alone) unless one was sent."""
        with self._lock:
            if not self.done:
                self.done = True
                self._release()
                self._client.close(error)

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self.done and self._client.is_cancelled()
