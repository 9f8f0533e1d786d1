"""`triton_vlm.serving.pipeline.Pipeline` without Triton: fake steps and clients, real threads."""
from __future__ import annotations

import threading
import time

import pytest

from triton_vlm.contract.tensors import Step
from triton_vlm.errors import InvalidInput
from triton_vlm.serving.pipeline import Failure, Pipeline, Reply, StepFailed, step_failure

TIMEOUT = 10
STEPS = [Step("preprocess", ("text_input",), ("input_ids",)), Step("encoder", ("input_ids",), ("embeddings",)),
         Step("llm", ("input_ids", "embeddings", "max_tokens"), ("output_ids",))]


class FakeClient:
    """Records what the pipeline sends; `cancel()` makes `is_cancelled()` true. Touching it after
    its final response is a test failure (in Triton: freed memory)."""

    def __init__(self) -> None:
        self.responses: list[tuple] = []   # ("send", outputs, final) / ("close", error)
        self.cancelled = False
        self.closed = threading.Event()
        self.after_final: list[str] = []

    def _touch(self, what: str) -> None:
        if self.closed.is_set():
            self.after_final.append(what)

    def send(self, outputs, final: bool) -> None:
        self._touch("send")
        self.responses.append(("send", outputs, final))
        if final:
            self.closed.set()

    def close(self, error=None) -> None:
        self._touch("close")
        self.responses.append(("close", error))
        self.closed.set()

    def is_cancelled(self) -> bool:
        self._touch("is_cancelled")
        return self.cancelled

    def wait(self) -> FakeClient:
        assert self.closed.wait(TIMEOUT)
        return self

    @property
    def finals(self) -> int:
        return sum(1 for r in self.responses if r[0] == "close" or r[2])

    @property
    def outputs(self) -> list:
        return [r[1] for r in self.responses if r[0] == "send"]


class FakeSteps:
    """`call`, `stream` and `stop` of a pipeline. Middle steps return `{output: (model, inputs)}`; the
    last step yields `replies` (a list, or a callable of the request id giving an iterable)."""

    def __init__(self, replies=None, fail: dict | None = None) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.streams: list[tuple[str, dict]] = []
        self.stops: list[str] = []
        self.replies = replies if replies is not None else [Reply(outputs=["t1"]), Reply(outputs=["t2"], final=True)]
        self.fail = fail or {}
        self.on_call = None   # called with the step before it answers

    def call(self, step: Step, tensors: dict, request_id: str) -> dict:
        self.calls.append((step.model, dict(tensors)))
        if self.on_call:
            self.on_call(step)
        if step.model in self.fail:
            raise StepFailed(self.fail[step.model])
        return {name: (step.model, tuple(sorted(tensors))) for name in step.outputs}

    def stream(self, step: Step, tensors: dict, request_id: str):
        self.streams.append((request_id, dict(tensors)))
        yield from (self.replies(request_id) if callable(self.replies) else self.replies)

    def stop(self, request_id: str) -> None:
        self.stops.append(request_id)

    def pipeline(self, max_inflight: int = 4, **kwargs) -> Pipeline:
        return Pipeline(STEPS, call=self.call, stream=self.stream, stop=self.stop, max_inflight=max_inflight,
                        poll_s=0.005, **kwargs)


def wait_until(condition, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_steps_run_in_order_with_the_tensors_they_take_and_replies_reach_the_client():
    fake = FakeSteps()
    pipeline = fake.pipeline()
    client = FakeClient()
    pipeline.submit({"text_input": "hi", "max_tokens": 4, "unused": 0}, client, "abc")
    client.wait()
    assert [m for m, _ in fake.calls] == ["preprocess", "encoder"]
    assert fake.calls[0][1] == {"text_input": "hi"}
    assert fake.calls[1][1] == {"input_ids": ("preprocess", ("text_input",))}
    request_id, given = fake.streams[0]
    assert request_id.startswith("abc-") and set(given) == {"input_ids", "embeddings", "max_tokens"}
    assert client.responses == [("send", ["t1"], False), ("send", ["t2"], True)]
    wait_until(lambda: pipeline.in_flight == 0)
    assert not fake.stops and not client.after_final
    pipeline.close()


def test_request_ids_are_unique_and_unguessable():
    """The llm takes a `stop` from anyone who names a request id: the ids the steps see carry 128
    random bits, so no client can name another's."""
    fake = FakeSteps()
    pipeline = fake.pipeline()
    clients = [FakeClient() for _ in range(3)]
    for client in clients:
        pipeline.submit({"text_input": "x"}, client, "same")
    for client in clients:
        client.wait()
    ids = {rid for rid, _ in fake.streams}
    assert len(ids) == 3
    for rid in ids:
        prefix, secret = rid.rsplit("-", 1)
        assert prefix == "same" and len(secret) == 32 and int(secret, 16) >= 0
    pipeline.close()


def test_a_failed_middle_step_ends_the_request_with_its_error_and_the_last_step_never_starts():
    error = step_failure("INVALID_ARG", "images[0]: not a decodable image")
    fake = FakeSteps(fail={"preprocess": error})
    pipeline = fake.pipeline()
    client = FakeClient()
    pipeline.submit({"text_input": "x"}, client)
    client.wait()
    assert client.responses == [("close", error)]
    assert [m for m, _ in fake.calls] == ["preprocess"] and not fake.streams
    wait_until(lambda: pipeline.in_flight == 0)
    pipeline.close()


def test_abort_ends_at_once_the_requests_waiting_on_a_dead_model_and_drops_what_comes_later():
    """A death of the llm ends the two requests streaming from it at once; the one in preprocess
    goes on; what the blocked streams give later reaches no client."""
    steps = [STEPS[0], Step("encoder", ("input_ids",), ("embeddings",), calls=("encoder_batch",)), STEPS[2]]
    release = {"preprocess": threading.Event(), "llm": threading.Event()}

    def late_replies(request_id: str):
        assert release["llm"].wait(TIMEOUT)
        yield Reply(outputs=["late"], final=True)

    fake = FakeSteps(replies=late_replies)
    fake.on_call = lambda step: step.model != "preprocess" or release["preprocess"].wait(TIMEOUT)
    pipeline = Pipeline(steps, call=fake.call, stream=fake.stream, stop=fake.stop, max_inflight=4, poll_s=0.005)
    streaming = [FakeClient(), FakeClient()]
    release["preprocess"].set()
    for client in streaming:
        pipeline.submit({"text_input": "a"}, client)
    wait_until(lambda: len(fake.streams) == 2)
    release["preprocess"].clear()
    in_preprocess = FakeClient()
    pipeline.submit({"text_input": "b"}, in_preprocess)
    wait_until(lambda: len(fake.calls) == 5)

    dead = Failure("UNAVAILABLE", "the llm step restarted; retry")
    assert pipeline.abort("encoder_batch", dead) == 0  # no request is in the encoder
    assert pipeline.abort("llm", dead) == 2
    assert all(client.wait().responses == [("close", dead)] for client in streaming)
    assert not in_preprocess.closed.is_set()
    release["llm"].set()
    release["preprocess"].set()
    assert in_preprocess.wait().outputs == [["late"]]
    wait_until(lambda: pipeline.in_flight == 0)
    assert all(client.responses == [("close", dead)] for client in streaming)
    assert not any(client.after_final for client in [*streaming, in_preprocess])
    pipeline.close()


def test_abort_of_a_model_a_step_calls_ends_the_requests_in_that_step_and_stops_them_there():
    steps = [STEPS[0], Step("encoder", ("input_ids",), ("embeddings",), calls=("encoder_batch",)), STEPS[2]]
    fake = FakeSteps()
    release = threading.Event()
    fake.on_call = lambda step: step.model == "encoder" and release.wait(TIMEOUT)
    pipeline = Pipeline(steps, call=fake.call, stream=fake.stream, stop=fake.stop, max_inflight=4, poll_s=0.005)
    client = FakeClient()
    pipeline.submit({"text_input": "a"}, client)
    wait_until(lambda: [m for m, _ in fake.calls] == ["preprocess", "encoder"])
    dead = Failure("UNAVAILABLE", "the encoder_batch step restarted; retry")
    assert pipeline.abort("preprocess", dead) == 0
    assert pipeline.abort("encoder_batch", dead) == 1
    assert client.wait().responses == [("close", dead)]
    release.set()  # the encoder's late answer: the request goes no further
    wait_until(lambda: pipeline.in_flight == 0)
    assert not fake.streams and not client.after_final
    pipeline.close()


@pytest.mark.parametrize("message, code", [("Request timeout expired", "UNAVAILABLE"),
                                           ("Exceeds maximum queue size", "UNAVAILABLE"),
                                           ("server busy: 3 requests; retry later", "UNAVAILABLE"),
                                           ("something broke", "INTERNAL")])
def test_refusals_for_now_seen_as_internal_are_passed_on_as_unavailable(message, code):
    message = f"vision_encoder_batch: {message}"
    assert step_failure("INTERNAL", message) == Failure(code, message)
    assert step_failure("INVALID_ARG", message).code == "INVALID_ARG"


def test_the_check_refuses_before_any_step():
    def check(inputs):
        if inputs["max_tokens"] < 1:
            raise InvalidInput(f"max_tokens: must be >= 1, got {inputs['max_tokens']}")

    fake = FakeSteps()
    pipeline = fake.pipeline(check=check)
    client = FakeClient()
    pipeline.submit({"text_input": "x", "max_tokens": 0}, client)
    client.wait()
    assert client.responses == [("close", Failure("INVALID_ARG", "max_tokens: must be >= 1, got 0"))]
    assert not fake.calls and not fake.streams
    pipeline.close()


def test_a_last_step_error_ends_the_request_and_the_stream_is_drained():
    error = Failure("INTERNAL", "llm: boom")
    drained = []

    def replies(request_id):
        yield Reply(outputs=["t1"])
        yield Reply(error=error)
        yield Reply(outputs=["t2"], final=True)  # after the end: drained, not sent
        drained.append(True)

    fake = FakeSteps(replies=replies)
    pipeline = fake.pipeline()
    client = FakeClient()
    pipeline.submit({"text_input": "x"}, client)
    client.wait()
    wait_until(lambda: pipeline.in_flight == 0)
    assert client.responses == [("send", ["t1"], False), ("close", error)]
    assert drained and client.finals == 1 and not client.after_final
    pipeline.close()


def test_the_final_response_is_sent_once():
    """A final reply, then more replies and the stream's end: one final response, nothing after."""
    fake = FakeSteps(replies=[Reply(outputs=["a"], final=True), Reply(outputs=["b"], final=True),
                              Reply(error=Failure("INTERNAL", "late")), Reply()])
    pipeline = fake.pipeline()
    client = FakeClient()
    pipeline.submit({"text_input": "x"}, client)
    client.wait()
    wait_until(lambda: pipeline.in_flight == 0)
    assert client.responses == [("send", ["a"], True)] and not client.after_final
    pipeline.close()


def test_a_stream_without_a_final_reply_gets_a_bare_final_response():
    fake = FakeSteps(replies=[Reply(outputs=["a"]), Reply()])
    pipeline = fake.pipeline()
    client = FakeClient()
    pipeline.submit({"text_input": "x"}, client)
    client.wait()
    assert client.responses == [("send", ["a"], False), ("close", None)]
    pipeline.close()


def test_cancellation_mid_stream_sends_exactly_one_stop():
    """The client cancels after the first reply; the last step goes on (as an llm does for a step)
    until the stop arrives, then ends the request: one stop for its id, one final response."""
    fake = FakeSteps()
    stopped = threading.Event()
    client = FakeClient()

    def replies(request_id):
        yield Reply(outputs=["t1"])
        client.cancelled = True
        while not stopped.wait(0.001):
            yield Reply(outputs=["more"])
        time.sleep(0.05)  # several watcher polls after the stop: still one stop
        yield Reply(outputs=[], final=True)

    fake.replies = replies
    real_stop = fake.stop

    def stop(request_id):
        real_stop(request_id)
        stopped.set()

    pipeline = Pipeline(STEPS, call=fake.call, stream=fake.stream, stop=stop, max_inflight=4, poll_s=0.005)
    pipeline.submit({"text_input": "x"}, client, "c")
    client.wait()
    wait_until(lambda: pipeline.in_flight == 0)
    time.sleep(0.05)
    assert fake.stops == [fake.streams[0][0]]
    assert client.finals == 1 and client.responses[-1] == ("send", [], True) and not client.after_final
    pipeline.close()


def test_a_request_cancelled_before_its_last_step_never_starts_it():
    fake = FakeSteps()
    client = FakeClient()
    fake.on_call = lambda step: setattr(client, "cancelled", step.model == "encoder" or client.cancelled)
    pipeline = fake.pipeline()
    pipeline.submit({"text_input": "x"}, client)
    client.wait()
    wait_until(lambda: pipeline.in_flight == 0)
    assert [m for m, _ in fake.calls] == ["preprocess", "encoder"]
    assert not fake.streams and not fake.stops
    assert client.responses == [("close", Failure("CANCELLED", "cancelled"))]
    pipeline.close()


def test_the_in_flight_cap_refuses_at_once_with_unavailable():
    release = threading.Event()

    def replies(request_id):
        release.wait(TIMEOUT)
        yield Reply(outputs=["done"], final=True)

    fake = FakeSteps(replies=replies)
    pipeline = fake.pipeline(max_inflight=1)
    first, second, third = FakeClient(), FakeClient(), FakeClient()
    pipeline.submit({"text_input": "x"}, first)
    pipeline.submit({"text_input": "x"}, second)
    assert second.closed.is_set()  # refused within submit
    assert second.responses == [("close", Failure("UNAVAILABLE", "server busy: 1 requests in flight, "
                                                                 "max_inflight_requests=1; retry later"))]
    release.set()
    first.wait()  # the next request, sent on seeing the final response, finds the place free
    pipeline.submit({"text_input": "x"}, third)
    assert third.wait().responses == [("send", ["done"], True)]
    assert len(fake.streams) == 2
    pipeline.close()


@pytest.mark.parametrize("ending", ["final reply", "error", "abort"])
def test_a_request_is_out_of_flight_before_its_final_response_goes(ending):
    """A client that sends its next request as soon as it sees a final response must not be refused
    for the one that response ended (the ensemble's test_faults saw "server busy" so)."""
    seen: list[int] = []

    class Watching(FakeClient):
        def send(self, outputs, final: bool) -> None:
            if final:
                seen.append(pipeline.in_flight)
            super().send(outputs, final)

        def close(self, error=None) -> None:
            seen.append(pipeline.in_flight)
            super().close(error)

    started = threading.Event()

    def replies(request_id):
        started.set()
        if ending == "abort":
            time.sleep(0.2)
        yield Reply(error=Failure("INTERNAL", "boom")) if ending == "error" else Reply(outputs=["t"], final=True)

    fake = FakeSteps(replies=replies)
    pipeline = fake.pipeline(max_inflight=1)
    client = Watching()
    pipeline.submit({"text_input": "x"}, client)
    if ending == "abort":
        assert started.wait(TIMEOUT)
        assert pipeline.abort("llm", Failure("UNAVAILABLE", "the llm step restarted; retry")) == 1
    client.wait()
    assert seen == [0]
    pipeline.close()


def test_an_exception_in_a_step_call_is_an_internal_error_and_frees_the_slot():
    fake = FakeSteps()
    fake.on_call = lambda step: 1 / 0
    pipeline = fake.pipeline(max_inflight=1)
    client = FakeClient()
    pipeline.submit({"text_input": "x"}, client)
    client.wait()
    assert client.responses == [("close", Failure("INTERNAL", "internal error in the ensemble; see the server log"))]
    fake.on_call = None
    again = FakeClient()
    pipeline.submit({"text_input": "x"}, again)
    assert again.wait().finals == 1
    pipeline.close()


def test_a_failing_stop_is_logged_and_the_watcher_goes_on(caplog):
    """A stop that raises (a dead llm) is logged; the next cancelled request still gets its stop."""
    stopped: dict[str, threading.Event] = {}

    def replies(request_id):
        stopped[request_id] = threading.Event()
        yield Reply(outputs=["t"])
        stopped[request_id].wait(TIMEOUT)
        yield Reply(outputs=[], final=True)

    def stop(request_id):
        stopped[request_id].set()
        if len(stopped) == 1:
            raise RuntimeError("llm is gone")

    fake = FakeSteps(replies=replies)
    pipeline = Pipeline(STEPS, call=fake.call, stream=fake.stream, stop=stop, max_inflight=4, poll_s=0.005)
    for _ in range(2):
        client = FakeClient()
        pipeline.submit({"text_input": "x"}, client)
        wait_until(lambda: bool(client.outputs))
        client.cancelled = True
        assert client.wait().finals == 1
    assert "stopping request" in caplog.text and "llm is gone" in caplog.text
    pipeline.close()


def test_no_client_is_held_once_its_request_is_done():
    """In Triton a client holds the request's response sender; one still referenced when the
    stub tears down is freed after its shared memory is gone (the ensemble stub's SIGSEGV at
    server stop). The watcher polls the running request here, then nothing may keep it."""
    import gc
    import weakref

    release = threading.Event()

    def replies(request_id):
        release.wait(TIMEOUT)
        yield Reply(outputs=["done"], final=True)

    fake = FakeSteps(replies=replies)
    pipeline = fake.pipeline()
    client = FakeClient()
    polled = threading.Event()
    # the watcher's poll, not the request thread's checks between steps
    client.is_cancelled = lambda: threading.current_thread() is pipeline._watcher and polled.set() or False
    pipeline.submit({"text_input": "x"}, client)
    assert polled.wait(TIMEOUT)
    release.set()
    client.wait()
    wait_until(lambda: pipeline.in_flight == 0)
    gone = weakref.ref(client)
    del client
    time.sleep(0.05)  # several empty polls of the watcher
    gc.collect()
    assert gone() is None
    pipeline.close()
    assert not pipeline._watcher.is_alive()


def test_a_step_with_its_skip_input_empty_is_not_called_and_gives_nothing():
    import numpy as np

    steps = [Step("preprocess", ("text_input",), ("pixel_values",)),
             Step("encoder", ("pixel_values",), ("embeddings",), skip_when_empty="pixel_values"),
             Step("llm", ("pixel_values", "embeddings"), ("output_ids",))]
    calls, streamed = [], []

    def call(step, tensors, request_id):
        calls.append(step.model)
        if step.model == "encoder":
            return {"embeddings": "rows"}
        return {"pixel_values": np.zeros((0 if tensors["text_input"] == "text only" else 4, 3))}

    def stream(step, tensors, request_id):
        streamed.append(sorted(tensors))
        yield Reply(outputs=["t"], final=True)

    pipeline = Pipeline(steps, call=call, stream=stream, stop=lambda rid: None, max_inflight=2, poll_s=0.005)
    for text in ("text only", "with media"):
        client = FakeClient()
        pipeline.submit({"text_input": text}, client)
        assert client.wait().responses == [("send", ["t"], True)]
    assert calls == ["preprocess", "preprocess", "encoder"]
    assert streamed == [["pixel_values"], ["embeddings", "pixel_values"]]
    pipeline.close()
