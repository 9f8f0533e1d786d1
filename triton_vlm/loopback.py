"""`GrpcSteps`: the ensemble's calls to its steps, over the server's own gRPC endpoint.

Why not BLS: the Python backend stub of Triton 2.51 (python_backend r24.10) turns every CPU output
tensor of a BLS response into a numpy array with the GIL released (`InferRequest::Exec` for a
unary call), and a decoupled model's responses are loaded on the stub's message-queue thread,
which never holds it. Any thread of the caller holding the GIL meanwhile (the pipeline's threads,
the stub's main thread loading the next request) races it in Python's and numpy's allocators:
with the llm streaming a response per token, the ensemble stub died under load (SIGSEGV in
pymalloc, "double free or corruption"; bench/RESULTS.md), taking every request in flight with it.
tritonclient builds its arrays in Python, under the GIL.

`stream` (the llm): each request takes a client and its open gRPC stream from a pool for its
duration, so the responses and the error it reads are its own; a stream whose request ended
cleanly serves the next. A gRPC stream carries an error's message only: the llm writes the code in
front of it (`with_code`) when the request has the `ERROR_CODES` parameter, and `failure_of`
reads it back.

`call` (preprocess, vision_encoder; the encoder front's call to vision_encoder_batch): the tensors
do not travel in gRPC messages (the pixel rows serialised twice halved image throughput on 2
cores). Each request id leases an `Arena` of system shared memory (`triton_vlm.shm_arena`) until
`release`: large inputs are written there, or are there already (an earlier step's output), and
Triton writes large outputs there; `stream` takes its inputs from there too. Small tensors (under
SHM_MIN_BYTES) cost less in the message. An output goes to the arena once one of its size was
seen, into a slot for the largest seen; one too small for a request makes the call run again with
the size Triton names.
"""
from __future__ import annotations

import logging
import os
import queue
import re
import threading
from typing import Iterator, Mapping, Sequence

import numpy as np

from triton_vlm.pipeline import Failure, StepFailed, step_failure
from triton_vlm.shm_arena import Arena, Slot

log = logging.getLogger("triton_vlm")

# Set by `triton_vlm.server.TritonServer` for the server it starts; tritonserver's default otherwise.
URL_ENV = "TRITON_VLM_GRPC_URL"
DEFAULT_URL = "127.0.0.1:8001"
# Request parameter asking the llm to prefix its error messages with their code.
ERROR_CODES = "vlm_error_codes"  # (tritonclient reserves names starting "triton_")

_GRPC_CODES = {"INVALID_ARGUMENT": "INVALID_ARG", "UNAVAILABLE": "UNAVAILABLE", "NOT_FOUND": "NOT_FOUND",
               "UNIMPLEMENTED": "UNSUPPORTED", "ALREADY_EXISTS": "ALREADY_EXISTS", "CANCELLED": "CANCELLED",
               "UNKNOWN": "UNKNOWN"}
_PREFIX = re.compile(r"\[(INVALID_ARG|UNAVAILABLE|INTERNAL|CANCELLED)\] ")
# Triton's answer when an output's shared-memory slot is too small for it.
_TOO_SMALL = re.compile(r"output '([^']+)' \((\d+) bytes\) should be at least (\d+) bytes")
# Tensors from this size on go through shared memory (smaller ones in the message).
SHM_MIN_BYTES = 64 << 10
_ADMIN_S = 10.0  # time limit of a shared-memory (un)registration


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
    """A client and its open gRPC stream, one request at a time: opening a stream costs about
    1 ms, so a stream that ended its request cleanly serves the next one."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.replies: queue.SimpleQueue = queue.SimpleQueue()
        self.open = False

    def start(self) -> None:
        if not self.open:
            self.replies = queue.SimpleQueue()  # nothing of an earlier stream is read
            self.client.start_stream(callback=lambda result, error: self.replies.put((result, error)))
            self.open = True

    def close(self) -> None:
        if self.open:
            self.open = False
            self.client.stop_stream()


class GrpcSteps:
    """Calls of the models of the server at `url` (host:port of its gRPC endpoint), made by a model
    of that server: unary ones through shared memory (`call`), streamed ones (`stream`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._idle: queue.SimpleQueue[_Stream] = queue.SimpleQueue()
        self._idle_arenas: queue.SimpleQueue[Arena] = queue.SimpleQueue()
        self._leased: dict[str, Arena] = {}
        self._seen: dict[tuple[str, str], int] = {}  # (model, output): its largest size in bytes
        self._lock = threading.Lock()
        self._unary = None  # one client serves every unary call (gRPC channels are thread-safe)

    def _client(self):
        with self._lock:
            if self._unary is None:
                import tritonclient.grpc as grpcclient

                self._unary = grpcclient.InferenceServerClient(self.url)
            return self._unary

    def _arena(self, request_id: str) -> Arena:
        """The arena of `request_id`, leased at its first call (until `release`)."""
        with self._lock:
            arena = self._leased.get(request_id)
        if arena is not None:
            return arena
        try:
            arena = self._idle_arenas.get_nowait()
        except queue.Empty:
            client = self._client()
            arena = Arena(lambda name, key, size: client.register_system_shared_memory(name, key, size,
                                                                                     client_timeout=_ADMIN_S),
                          lambda name: client.unregister_system_shared_memory(name, client_timeout=_ADMIN_S))
        with self._lock:
            self._leased[request_id] = arena
        return arena

    def release(self, request_id: str) -> None:
        """`request_id` is over: its arena serves the next request."""
        with self._lock:
            arena = self._leased.pop(request_id, None)
        if arena is None:
            return
        try:
            arena.reset()
        except Exception:  # a new region could not be registered (the server is going away)
            log.exception("shared memory of request %s not reused", request_id)
            return
        self._idle_arenas.put(arena)

    def _saw(self, model: str, output: str, nbytes: int) -> None:
        key = (model, output)
        if nbytes > self._seen.get(key, 0):
            self._seen[key] = nbytes

    def close(self) -> None:
        """Unregister every idle arena's memory (leased ones go with the process)."""
        while True:
            try:
                self._idle_arenas.get_nowait().close()
            except queue.Empty:
                return
            except Exception:  # the server is going away too
                continue

    def call(self, model: str, tensors: Mapping[str, np.ndarray], outputs: Sequence[str], request_id: str,
             sizes: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
        """One unary call of `model` through the arena of `request_id`: its (numeric) `outputs`
        present in the response, valid until `release(request_id)`; StepFailed on its error.

        An output comes in the message until one of SHM_MIN_BYTES or more was seen (small ones
        cost less so), then in a slot of the arena sized for the largest seen. `sizes`: the bytes
        of outputs the caller knows (a batched model would otherwise run again when one outgrows
        its slot)."""
        from tritonclient.utils import InferenceServerException

        arena = self._arena(request_id)
        client = self._client()
        for _ in range(len(outputs) + 1):  # each retry grows one output's slot to its size
            mark = arena.mark()
            try:
                slots = {}
                for name in outputs:
                    size = max((sizes or {}).get(name, 0), self._seen.get((model, name), 0))
                    if size >= SHM_MIN_BYTES:
                        slots[name] = arena.alloc(size + size // 4)
                requested = [_requested(name, slots.get(name)) for name in outputs]
                result = client.infer(model, _inputs(tensors, arena), request_id=request_id, outputs=requested)
            except InferenceServerException as error:
                too_small = _TOO_SMALL.search(error.message() or "")
                arena.rollback(mark)
                if too_small is None:
                    raise StepFailed(self._failure(error)) from None
                self._saw(model, too_small.group(1), int(too_small.group(3)))
                continue
            got = {}
            for name in outputs:
                output = result.get_output(name)
                if output is None:
                    continue
                slot = slots.get(name)
                got[name] = _read(output, slot) if slot else result.as_numpy(name)
                self._saw(model, name, got[name].nbytes)
            return got
        raise StepFailed(Failure("INTERNAL", f"{model}: outputs kept outgrowing their shared memory"))

    def stream(self, model: str, tensors: Mapping[str, np.ndarray], outputs: Sequence[str],
               request_id: str) -> Iterator[dict[str, np.ndarray] | Failure]:
        """A decoupled model's responses, each its `outputs` present in it (responses without
        any, such as the empty final one, are not given); an error is the last item. Responses of
        another request id (an earlier request's, on a reused stream) are skipped."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        try:
            stream = self._idle.get_nowait()
        except queue.Empty:
            stream = _Stream(self.url)
        finished = False  # the request's final response came: the stream may serve another
        try:
            stream.start()
            try:
                stream.client.async_stream_infer(model, _inputs(tensors, self._arena(request_id)), request_id=request_id,
                                                 outputs=[grpcclient.InferRequestedOutput(name) for name in outputs],
                                                 parameters={ERROR_CODES: True}, enable_empty_final_response=True)
            except InferenceServerException as refused:
                # a stream that failed at once (no server there) told its callback why
                try:
                    refused = stream.replies.get(timeout=5.0)[1] or refused
                except queue.Empty:
                    pass
                yield self._failure(refused)
                return
            while True:
                result, error = stream.replies.get()
                if error is not None:
                    finished = not error.status()  # the model's error ends its request; a transport error the stream
                    yield self._failure(error)
                    return
                response = result.get_response()
                if response.id != request_id:
                    continue
                got = {name: array for name in outputs if (array := result.as_numpy(name)) is not None}
                if got:
                    yield got
                if response.parameters["triton_final_response"].bool_param:
                    finished = True
                    return
        except InferenceServerException as error:
            yield self._failure(error)
        finally:
            if not finished:
                stream.close()
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


def _inputs(tensors: Mapping[str, np.ndarray], arena: Arena | None = None) -> list:
    """InferInputs: with an arena, a large numeric array goes by shared memory (from where it lies
    in the arena, an earlier step's output, or copied in); the rest in the message."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        if arena is not None and array.dtype != np.object_ and array.nbytes >= SHM_MIN_BYTES:
            slot = arena.put(array)
            tensor.set_shared_memory(slot.region.name, array.nbytes, slot.offset)
        else:
            tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _requested(name: str, slot: Slot | None):
    """An InferRequestedOutput: into `slot`, or in the message."""
    import tritonclient.grpc as grpcclient

    output = grpcclient.InferRequestedOutput(name)
    if slot is not None:
        output.set_shared_memory(slot.region.name, slot.size, slot.offset)
    return output


def _read(output, slot: Slot) -> np.ndarray:
    """A numeric output that Triton wrote into `slot`, in place."""
    from tritonclient.utils import triton_to_np_dtype

    return slot.view(np.dtype(triton_to_np_dtype(output.datatype)), tuple(output.shape))
