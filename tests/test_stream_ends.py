"""Which gRPC streams our clients cancel: only those whose request did not end. Triton 2.51 keeps
the request message and call of a stream cancelled after its last response, for good (heaptrack:
13 MB over 1,500 of the soak's mixed requests; bench/RESULTS.md, "What tritonserver's heap
held"). So the ensemble's stream to the llm, `generate` and `stream_generate` let a stream whose
final response (or the ensemble's error, which ends its request) came end by itself, and cancel
one left before (a client gone, a step dead). No server: the clients' own calls, faked."""
from __future__ import annotations

import asyncio
import queue
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from triton_vlm.clients import client as clients
from triton_vlm.serving import loopback
from triton_vlm.serving.pipeline import Failure

TENSORS = {"input_ids": np.array([[1, 2]], dtype=np.int32)}


class Final:
    """A stream's last response, as tritonclient gives it: no outputs, the final flag."""

    def __init__(self, request_id: str = "") -> None:
        flag = SimpleNamespace(bool_param=True)
        self.response = SimpleNamespace(id=request_id, outputs=[], parameters={"triton_final_response": flag})

    def get_response(self):
        return self.response

    def as_numpy(self, name):
        return None


class FakeClient:
    """tritonclient's InferenceServerClient, whose stream answers each request with `answer`."""
    answer = staticmethod(lambda request_id: (Final(request_id), None))

    def __init__(self, url: str, *args, **kwargs) -> None:
        pass

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def start_stream(self, callback) -> None:
        self.callback = callback

    def async_stream_infer(self, model, inputs, request_id: str = "", **kwargs) -> None:
        if (reply := self.answer(request_id)) is not None:
            self.callback(*reply)


@pytest.fixture
def closed(monkeypatch) -> list[bool]:
    """Each stream closed, as whether it was cancelled."""
    closes: list[bool] = []
    for module in (loopback, clients):
        monkeypatch.setattr(module, "close_stream", lambda client, cancel: closes.append(cancel))
    monkeypatch.setattr("tritonclient.grpc.InferenceServerClient", FakeClient)
    return closes


def test_the_ensembles_stream_to_the_llm(closed, monkeypatch):
    steps = loopback.GrpcSteps("127.0.0.1:1")
    assert list(steps.stream("llm", TENSORS, ["output_ids"], "r1")) == []  # (the final response has no outputs)
    assert closed == [False]

    monkeypatch.setattr(FakeClient, "answer", staticmethod(lambda request_id: None))  # no answer comes
    dead = Failure("UNAVAILABLE", "the llm step restarted; retry")
    threading.Timer(0.2, steps.abort, ("llm", dead)).start()  # its step dies meanwhile
    assert list(steps.stream("llm", TENSORS, ["output_ids"], "r2")) == [dead]
    assert closed == [False, True]


def test_generate(closed, monkeypatch):
    assert clients.generate("127.0.0.1:1", "hi").output_ids == []
    error = InferenceServerException("images[0]: not an image")  # the ensemble's error: its request ended
    monkeypatch.setattr(FakeClient, "answer", staticmethod(lambda request_id: (None, error)))
    with pytest.raises(clients.RequestError, match="not an image"):
        clients.generate("127.0.0.1:1", "hi")
    monkeypatch.setattr(FakeClient, "answer", staticmethod(lambda request_id: None))
    with pytest.raises(queue.Empty):  # no answer within the timeout: the request is left, so cancelled
        clients.generate("127.0.0.1:1", "hi", timeout=0.2)
    assert closed == [False, False, True]


class FakeCall:
    """A grpc.aio stream call: its responses, then its end if it `ends` (else never)."""

    def __init__(self, responses: list, ends: bool) -> None:
        self.responses, self.ends = responses, ends
        self.done = self.cancelled = False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for response in self.responses:
            yield response

    async def code(self):
        if not self.ends:
            await asyncio.Event().wait()
        self.done = True
        return "OK"

    def cancel(self) -> bool:
        self.cancelled = not self.done  # a no-op on a call that has ended
        return self.cancelled


def aio_response(final: bool, error: str = "") -> SimpleNamespace:
    flag = SimpleNamespace(bool_param=final)
    return SimpleNamespace(error_message=error,
                           infer_response=SimpleNamespace(outputs=[], parameters={"triton_final_response": flag}))


@pytest.mark.parametrize("error", ["", "images[0]: not an image"])
def test_stream_generate(monkeypatch, error):
    from tritonclient.grpc import service_pb2_grpc

    async def run(call: FakeCall) -> None:
        stub = SimpleNamespace(ModelStreamInfer=lambda requests: call)
        monkeypatch.setattr(service_pb2_grpc, "GRPCInferenceServiceStub", lambda channel: stub)
        monkeypatch.setattr(clients, "_infer_request", lambda values, request_id: None)
        try:
            assert [i async for i in clients.stream_generate(None, {})] == []
        except clients.RequestError:
            assert error

    ended = FakeCall([aio_response(final=not error, error=error)], ends=True)
    asyncio.run(run(ended))
    assert not ended.cancelled
    # a server that does not end the stream within the wait: cancelled all the same
    hanging = FakeCall([aio_response(final=not error, error=error)], ends=False)
    monkeypatch.setattr(clients, "CLOSE_WAIT_S", 0.2)
    asyncio.run(run(hanging))
    assert hanging.cancelled


class StreamServer:
    """A gRPC server with Triton's stream call alone: it answers each request with a final response,
    then ends the stream once the client's half has ended, or, `wedged`, never: only a cancel ends it."""

    def __init__(self, wedged: bool) -> None:
        from concurrent import futures

        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.ended, self.cancelled = threading.Event(), False
        server = self

        class Service(service_pb2_grpc.GRPCInferenceServiceServicer):
            def ModelStreamInfer(self, requests, context):
                for request in requests:
                    response = service_pb2.ModelInferResponse(id=request.id)
                    response.parameters["triton_final_response"].bool_param = True
                    yield service_pb2.ModelStreamInferResponse(infer_response=response)
                while wedged and context.is_active():
                    threading.Event().wait(0.02)
                server.cancelled = not context.is_active()
                server.ended.set()

        self.grpc = grpc.server(futures.ThreadPoolExecutor(2))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Service(), self.grpc)
        self.url = f"127.0.0.1:{self.grpc.add_insecure_port('127.0.0.1:0')}"
        self.grpc.start()


@pytest.mark.parametrize("wedged", [False, True])
def test_close_stream_waits_a_bounded_time(monkeypatch, wedged):
    """A stream whose request ended is closed without cancelling, and the server ends it; one the
    server never ends is cancelled after CLOSE_WAIT_S, instead of holding its caller for good."""
    import time

    import tritonclient.grpc as grpcclient

    monkeypatch.setattr(clients, "CLOSE_WAIT_S", 0.5)
    server = StreamServer(wedged)
    try:
        with grpcclient.InferenceServerClient(server.url) as client:
            finals = queue.SimpleQueue()
            client.start_stream(callback=lambda result, error: finals.put(error))
            handler = client._stream._handler
            client.async_stream_infer("ensemble", [], request_id="r1", enable_empty_final_response=True)
            assert finals.get(timeout=10) is None
            start = time.monotonic()
            clients.close_stream(client, cancel=False)
            took = time.monotonic() - start
        assert not handler.is_alive()
        assert server.ended.wait(5) and server.cancelled == wedged  # cancelled only when the server never ended it
        assert (took >= 0.5) == wedged and took < 5
    finally:
        server.grpc.stop(None)
