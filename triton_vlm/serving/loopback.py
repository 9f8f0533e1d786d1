"""`GrpcSteps`: the ensemble's streamed call to the llm, over the server's own gRPC endpoint.

Why not BLS for this one step: in Triton 2.51 (python_backend r24.10) a streamed BLS call keeps
every per-token response in the stub and frees them, numpy arrays included, on a stub thread that
does not hold the GIL (fixed in r25.01, python_backend PR 390: "When deleting NumPy arrays in C++,
GIL must be held"); with the llm streaming a response per token, the ensemble stub died under load
(SIGSEGV in pymalloc, "double free or corruption"; bench/RESULTS.md), taking every request in
flight with it. tritonclient builds and frees its arrays in Python, under the GIL. The unary steps
stay on BLS, whose responses are built and freed under the GIL (README, "Why BLS").

Each request takes a client and its open gRPC stream from a pool for its duration, so the
responses and the error it reads are its own; a stream whose request ended cleanly serves the next
(opening one costs about 1 ms). The tensors travel in the gRPC message: the llm's inputs are ids,
positions and the embedding rows, no pixels. A gRPC stream carries an error's message only: the llm
writes the code in front of it (`with_code`) when the request has the `ERROR_CODES` parameter, and
`failure_of` reads it back.
"""
from __future__ import annotations

import os
import queue
import re
import threading
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from triton_vlm.clients.client import close_stream
from triton_vlm.contract.params import DEFAULT_URL, ERROR_CODES, URL_ENV
from triton_vlm.contract.tensors import llm_inputs
from triton_vlm.serving.pipeline import Failure, step_failure

# The llm's inputs by name: each tensor travels as its spec says.
_SPECS = {spec.name: spec for spec in llm_inputs(-1)}

_GRPC_CODES = {"INVALID_ARGUMENT": "INVALID_ARG", "UNAVAILABLE": "UNAVAILABLE", "NOT_FOUND": "NOT_FOUND",
               "UNIMPLEMENTED": "UNSUPPORTED", "ALREADY_EXISTS": "ALREADY_EXISTS", "CANCELLED": "CANCELLED",
               "UNKNOWN": "UNKNOWN"}
_PREFIX = re.compile(r"\[(INVALID_ARG|UNAVAILABLE|INTERNAL|CANCELLED)\] ")


def server_url() -> str:
    return os.environ.get(URL_ENV) or DEFAULT_URL


def with_code(code: str, message: str) -> str:
    """A streamed error message that keeps its code (read back by `failure_of`)."""
    return f"[{code}] {message}"


def failure_of(error) -> Failure:
    """A tritonclient `InferenceServerException` as the Failure to answer with."""
    message = error.message() or str(error)
    status = (error.status() or "").removeprefix("StatusCode.")
    code = _GRPC_CODES.get(status, "INTERNAL")
    tagged = _PREFIX.search(message)
    if tagged:
        code, message = tagged.group(1), message[:tagged.start()] + message[tagged.end():]
    return step_failure(code, message)


class _Stream:
    """A client (its channel serves request after request) and a gRPC stream for one request at
    a time, closed when the request ends: a stream Triton has served keeps the model it called
    alive, so an idle stream held an unloaded llm (its stub and memory) for good after an
    operator's reload. A stream per request costs about 8 ms served (bench/RESULTS.md)."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.replies: queue.SimpleQueue = queue.SimpleQueue()
        self.open = False

    def start(self) -> None:
        if not self.open:
            replies = self.replies  # (an `abort` may have put its failure there already)
            self.client.start_stream(callback=lambda result, error: replies.put((result, error)))
            self.open = True

    def close(self, ended: bool) -> None:
        """Close the stream; the next request reads nothing of this one. Where its request `ended`
        (its final response came), the stream is closed as a client ends its requests; else what
        it still has in flight is cancelled (a dead step never answers it: nothing else would end
        it). Not always cancelled: Triton 2.51 keeps for good the request message (the llm's inputs)
        of a stream cancelled as its last response completes, 86 kB each for the soak's images, a
        third of them in a mix with refused requests (heaptrack; server PR 8078 fixed such races)."""
        if self.open:
            self.open = False
            close_stream(self.client, cancel=not ended)
        self.replies = queue.SimpleQueue()


class GrpcSteps:
    """Streamed calls of the models of the server at `url` (host:port of its gRPC endpoint), made
    by a model of that server. `refusal(model)`: why a request must not go to `model` now (its stub
    died and it is not back), or None; asked once the request's stream is registered, so that a
    death is either seen there or reaches the stream through `abort`."""

    def __init__(self, url: str, refusal: Callable[[str], Failure | None] = lambda model: None) -> None:
        self.url, self.refusal = url, refusal
        self._idle: queue.SimpleQueue[_Stream] = queue.SimpleQueue()
        self._busy: dict[_Stream, str] = {}  # streams with a request in flight -> the model called
        self._lock = threading.Lock()

    def abort(self, model: str, failure: Failure) -> None:
        """End every request in flight to `model` with `failure` (its stub died: no response will
        come)."""
        with self._lock:  # (a stream leaves `_busy` before its queue is renewed for the next request)
            for stream, called in self._busy.items():
                if called == model:
                    stream.replies.put((None, failure))

    def stream(self, model: str, tensors: Mapping[str, np.ndarray], outputs: Sequence[str],
               request_id: str) -> Iterator[dict[str, np.ndarray] | Failure]:
        """A decoupled model's responses, each its `outputs` present in it (responses without
        any, such as the empty final one, are not given); an error is the last item. Responses of
        another request id are skipped."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        try:
            stream = self._idle.get_nowait()
        except queue.Empty:
            stream = _Stream(self.url)
        with self._lock:
            self._busy[stream] = model
        ended = False
        try:
            # Not before: a death seen between that check and the registration reached neither.
            refused = self.refusal(model)
            if refused is not None:
                yield refused
                return
            stream.start()
            try:
                stream.client.async_stream_infer(model, _inputs(tensors), request_id=request_id,
                                                 outputs=[grpcclient.InferRequestedOutput(name) for name in outputs],
                                                 parameters={ERROR_CODES: True}, enable_empty_final_response=True)
            except InferenceServerException as error:
                # a stream that failed at once (no server there) told its callback why
                try:
                    error = stream.replies.get(timeout=5.0)[1] or error
                except queue.Empty:
                    pass
                yield error if isinstance(error, Failure) else self._failure(error)
                return
            while True:
                result, error = stream.replies.get()
                if isinstance(error, Failure):  # `abort`
                    yield error
                    return
                if error is not None:
                    yield self._failure(error)
                    return
                response = result.get_response()
                if response.id != request_id:
                    continue
                got = {name: array for name in outputs if (array := result.as_numpy(name)) is not None}
                if got:
                    yield got
                if response.parameters["triton_final_response"].bool_param:
                    ended = True
                    return
        except InferenceServerException as error:
            yield self._failure(error)
        finally:
            with self._lock:
                del self._busy[stream]
            stream.close(ended)
            self._idle.put(stream)

    def _failure(self, error) -> Failure:
        """`failure_of(error)`; when no server answered (`_unreached`), it names the endpoint,
        which a server started by hand may need to be told."""
        failure = failure_of(error)
        if _unreached(error):
            return Failure(failure.code, f"this model's gRPC connection to {self.url} (set {URL_ENV} to the "
                                         f"server's gRPC address): {failure.message}")
        return failure


def _unreached(error) -> bool:
    """An error of the gRPC call itself: no server answered (a model's own errors on a stream have no
    status; a unary call's have theirs, UNAVAILABLE included)."""
    status = error.status() or ""
    if not status:
        return False
    if status.endswith("UNAVAILABLE"):
        message = (error.message() or "").lower()
        return any(m in message for m in ("failed to connect", "connection refused", "socket closed",
                                          "connections to all backends failing"))
    return not any(status.endswith(code) for code in ("INVALID_ARGUMENT", "INTERNAL", "CANCELLED", "NOT_FOUND",
                                                        "UNKNOWN", "UNIMPLEMENTED", "ALREADY_EXISTS"))


def _inputs(tensors: Mapping[str, np.ndarray]) -> list:
    """InferInputs carrying `tensors` in the message, each as the contract's spec of that llm input."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, array in tensors.items():
        spec = _SPECS[name]
        array = spec.array(array)
        tensor = grpcclient.InferInput(name, list(array.shape), spec.dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs
