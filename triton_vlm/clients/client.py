"""Clients of the `ensemble`: gRPC streaming (tritonclient) and Triton's HTTP generate endpoints.

A decoupled model is reachable over gRPC only through the streaming API, so a non-streaming
request is the same stream with `stream=false`: one response with the whole answer.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import queue
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable

import numpy as np

if TYPE_CHECKING:
    import grpc
    from tritonclient.grpc import service_pb2

MODEL = "ensemble"
# The ensemble's output with the expanded prompt's length (`usage.prompt_tokens`), where it has one.
PROMPT_TOKENS_OUTPUT = "num_input_tokens"
# Seconds a client waits for the server to end a stream whose requests ended, before it cancels it.
CLOSE_WAIT_S = 5.0


class RequestError(RuntimeError):
    """The server refused or failed the request; the message is the server's."""


@dataclass
class GenerationResult:
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    responses: int = 0
    time_to_first_token: float | None = None
    total_time: float = 0.0


def _sampling_values(max_tokens, temperature, top_p, top_k, seed, stop_words, stream, repetition_penalty=None,
                     min_tokens=None, presence_penalty=None, frequency_penalty=None, bad_words=None,
                     return_log_probs=None, num_top_log_probs=None, num_return_sequences=None) -> dict[str, tuple]:
    """name -> (numpy value, Triton datatype) for the sampling inputs that are set."""
    values = {"max_tokens": (np.array([max_tokens], np.int32), "INT32"),
              "stream": (np.array([stream], bool), "BOOL")}
    for name, value, dtype, triton in (("temperature", temperature, np.float32, "FP32"),
                                       ("top_p", top_p, np.float32, "FP32"),
                                       ("top_k", top_k, np.int32, "INT32"),
                                       ("min_tokens", min_tokens, np.int32, "INT32"),
                                       ("seed", seed, np.uint64, "UINT64"),
                                       ("repetition_penalty", repetition_penalty, np.float32, "FP32"),
                                       ("presence_penalty", presence_penalty, np.float32, "FP32"),
                                       ("frequency_penalty", frequency_penalty, np.float32, "FP32"),
                                       ("return_log_probs", return_log_probs, bool, "BOOL"),
                                       ("num_top_log_probs", num_top_log_probs, np.int32, "INT32"),
                                       ("num_return_sequences", num_return_sequences, np.int32, "INT32")):
        if value is not None:
            values[name] = (np.array([value], dtype), triton)
    for name, words in (("stop_words", stop_words), ("bad_words", bad_words)):
        if words:
            values[name] = (np.array([w.encode() for w in words], np.object_), "BYTES")
    return values


def request_values(prompt: str, images=(), videos=(), mm_options: dict | None = None, max_tokens: int = 64,
                   temperature=None, top_p=None, top_k=None, seed=None, stop_words=None, repetition_penalty=None,
                   stream: bool = True, min_tokens=None, presence_penalty=None, frequency_penalty=None,
                   bad_words=None, return_log_probs=None, guide_type: str | None = None,
                   guide: str | None = None, num_top_log_probs=None, num_return_sequences=None) -> dict[str, tuple]:
    """The ensemble's inputs; `guide_type` and `guide` are `guided_decoding_guide_type` and
    `guided_decoding_guide` (`triton_vlm.contract.sampling.GUIDE_TYPES`)."""
    values = {"text_input": (np.array([prompt.encode()], np.object_), "BYTES")}
    for name, items in (("images", images), ("videos", videos)):
        if items:
            values[name] = (np.array(list(items), np.object_), "BYTES")
    if mm_options:
        values["mm_options"] = (np.array([json.dumps(mm_options).encode()], np.object_), "BYTES")
    values.update(_sampling_values(max_tokens, temperature, top_p, top_k, seed, stop_words, stream, repetition_penalty,
                                   min_tokens, presence_penalty, frequency_penalty, bad_words, return_log_probs,
                                   num_top_log_probs, num_return_sequences))
    for name, text in (("guided_decoding_guide_type", guide_type), ("guided_decoding_guide", guide)):
        if text is not None:
            values[name] = (np.array([text.encode()], np.object_), "BYTES")
    return values


def grpc_inputs(values: dict[str, tuple]) -> list:
    """tritonclient gRPC inputs from `request_values`-style {name: (array, datatype)}."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, (value, dtype) in values.items():
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def generate(url: str, prompt: str, images=(), videos=(), *, on_text: Callable[[str], None] | None = None,
             timeout: float = 600.0, **kwargs) -> GenerationResult:
    """One request over gRPC streaming; `on_text` sees each text increment as it arrives."""
    import tritonclient.grpc as grpcclient

    inputs = grpc_inputs(request_values(prompt, images, videos, **kwargs))
    responses: queue.Queue = queue.Queue()
    result = GenerationResult()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        start = time.perf_counter()
        finished = False
        try:
            send_on_stream(client, MODEL, inputs, enable_empty_final_response=True)
            while True:
                res, err = responses.get(timeout=timeout)  # queue.Empty: no response within `timeout`
                if err is not None:
                    # the ensemble's error ends its request (or the stream broke): nothing to cancel,
                    # and Triton 2.51 keeps the memory of a stream cancelled after its last response
                    finished = True
                    raise RequestError(stream_error(err))
                response = res.get_response()
                if response.outputs:
                    ids = res.as_numpy("output_ids")
                    text = b"".join(res.as_numpy("text_output")).decode("utf-8")
                    reason = b"".join(res.as_numpy("finish_reason")).decode()
                    if result.time_to_first_token is None and len(ids):
                        result.time_to_first_token = time.perf_counter() - start
                    result.output_ids.extend(int(i) for i in ids)
                    result.text += text
                    result.finish_reason = reason or result.finish_reason
                    result.responses += 1
                    if on_text and text:
                        on_text(text)
                if response.parameters["triton_final_response"].bool_param:
                    finished = True
                    break
        finally:
            # a request that did not finish is cancelled: stop_stream alone would wait for it
            close_stream(client, cancel=not finished)
    result.total_time = time.perf_counter() - start
    return result


def close_stream(client, cancel: bool) -> None:
    """`client.stop_stream(cancel_requests=cancel)`, and the end of the stream's requests.

    Not cancelled, the stream ends when the server has ended it (its requests' last responses
    came): tritonclient then joins its reader thread without a limit, so a server that never ends
    the stream (wedged) would hold the caller for good. Here the wait is CLOSE_WAIT_S, and a stream
    still open then is cancelled.

    tritonclient (2.73, as its main branch) ends a cancelled stream without ending the iterator
    that feeds it requests, so gRPC's thread that reads that iterator waits for a next request
    for good: one thread, with the stream's callback and what it holds, per cancelled stream
    (grpc issue 21995). The ensemble cancelled its llm stream at the end of every request, and
    its stub gained a thread a request; a client retrying through a server restart gained hundreds.
    The iterator's end marker (None) ends that thread; a second one is never read."""
    stream = client._stream  # (tritonclient's own: no public way to end the request iterator or bound the wait)
    if stream is not None and not cancel and stream._handler is not None:
        stream._request_queue.put(None)  # the client's half of the stream ends: the server then ends it
        stream._handler.join(CLOSE_WAIT_S)
        cancel = stream._handler.is_alive()
    client.stop_stream(cancel_requests=cancel)
    if stream is not None:
        stream._request_queue.put(None)


def send_on_stream(client, model: str, inputs: list, **kwargs) -> None:
    """`async_stream_infer` on a started stream. When the stream broke before the request went
    (no server there), its callback has the error already: the caller reads it from there, as
    any other."""
    from tritonclient.utils import InferenceServerException

    try:
        client.async_stream_infer(model, inputs, **kwargs)
    except InferenceServerException:
        pass


def stream_error(error: Exception) -> str:
    """A stream's error as its message; a broken stream's with its gRPC status first
    ("StatusCode.UNAVAILABLE: Socket closed": the server went)."""
    message = error.message() if hasattr(error, "message") else str(error)
    status = error.status() if hasattr(error, "status") else None
    return f"{status}: {message}" if status and status.startswith("StatusCode.") else message


@dataclass
class Increment:
    """One response of a streamed request: new text and ids; the finish reason on the last one."""
    text: str
    output_ids: list[int]
    finish_reason: str
    prompt_tokens: int | None  # the expanded prompt's length, where the ensemble reports it
    logprobs: list[float] | None = None  # each id's log-probability, where asked (`return_log_probs`)
    # each id's most likely alternatives, (id, log-probability) most likely first (`num_top_log_probs`)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    sequence_index: int = 0  # which of the request's sequences (`num_return_sequences`)


def aio_channel(url: str) -> grpc.aio.Channel:
    """An asyncio gRPC channel to the server, message sizes unbounded as in tritonclient. It tries
    to reconnect at least every second (gRPC's backoff grows to 120 s): a server that `triton-vlm
    serve` restarted is back within seconds, and so should its clients be."""
    import grpc

    limit = 2**31 - 1
    return grpc.aio.insecure_channel(url, options=[("grpc.max_send_message_length", limit),
                                                   ("grpc.max_receive_message_length", limit),
                                                   ("grpc.max_reconnect_backoff_ms", 1000)])


def _infer_request(values: dict[str, tuple], request_id: str) -> service_pb2.ModelInferRequest:
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import serialize_byte_tensor

    request = service_pb2.ModelInferRequest(model_name=MODEL, id=request_id)
    for name, (value, dtype) in values.items():
        request.inputs.add(name=name, datatype=dtype, shape=value.shape)
        request.raw_input_contents.append(serialize_byte_tensor(value).item() if dtype == "BYTES" else value.tobytes())
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


async def stream_generate(channel: grpc.aio.Channel, values: dict[str, tuple],
                          request_id: str = "") -> AsyncIterator[Increment]:
    """One request (`request_values`) over gRPC streaming with asyncio, yielding each response.

    Closing the iterator early (its task cancelled, e.g. because the HTTP client went away)
    cancels the gRPC call: the `ensemble` sees the cancellation and stops the `llm`, which frees
    the request's KV blocks. A refusal raises RequestError with the server's message; a transport
    failure raises `grpc.aio.AioRpcError`.
    """
    from tritonclient.grpc import InferResult, service_pb2_grpc

    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    call = stub.ModelStreamInfer(iter([_infer_request(values, request_id)]))
    try:
        async for response in call:
            if response.error_message:
                await _ended(call)  # (the ensemble's error ends its request)
                raise RequestError(response.error_message)
            result = InferResult(response.infer_response)
            if response.infer_response.outputs:
                yield _increment(result)
            if response.infer_response.parameters["triton_final_response"].bool_param:
                await _ended(call)
                return
    finally:
        call.cancel()  # a no-op once the call has ended


def _increment(result) -> Increment:
    """An ensemble response (tritonclient `InferResult`) as an `Increment`."""
    prompt_tokens, logprobs = result.as_numpy(PROMPT_TOKENS_OUTPUT), result.as_numpy("output_log_probs")
    top, top_ids, index = (result.as_numpy(n) for n in ("top_log_probs", "top_log_prob_ids", "sequence_index"))
    return Increment(b"".join(result.as_numpy("text_output")).decode("utf-8"),
                     [int(i) for i in result.as_numpy("output_ids")],
                     b"".join(result.as_numpy("finish_reason")).decode(),
                     None if prompt_tokens is None else int(prompt_tokens.reshape(-1)[0]),
                     None if logprobs is None else [float(p) for p in logprobs.reshape(-1)],
                     None if top is None else [list(zip(map(int, i), map(float, p)))
                                               for i, p in zip(top_ids.reshape(-1, top.shape[-1]),
                                                               top.reshape(-1, top.shape[-1]))],
                     0 if index is None else int(index.reshape(-1)[0]))


async def _ended(call) -> None:
    """Wait for the end of a stream whose request ended (the server ends it at once: its one
    request was sent), up to CLOSE_WAIT_S; the caller cancels it only if it has not ended: Triton
    2.51 keeps the request message of a stream cancelled after its last response (bench/RESULTS.md)."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(call.code(), CLOSE_WAIT_S)


def generate_payload(prompt: str, images=(), videos=(), mm_options: dict | None = None, max_tokens: int = 64,
                     **sampling) -> dict:
    """The JSON body of `/v2/models/ensemble/generate`: media as base64 text."""
    body = {"text_input": prompt, "max_tokens": max_tokens}
    if images:
        body["images"] = [base64.b64encode(b).decode() for b in images]
    if videos:
        body["videos"] = [base64.b64encode(b).decode() for b in videos]
    if mm_options:
        body["mm_options"] = json.dumps(mm_options)
    body.update({k: v for k, v in sampling.items() if v is not None})
    return body


def http_generate(url: str, body: dict, stream: bool = False, timeout: float = 600.0) -> list[dict]:
    """POST to generate (one JSON answer) or generate_stream (one per `data:` event)."""
    endpoint = "generate_stream" if stream else "generate"
    request = urllib.request.Request(f"http://{url}/v2/models/{MODEL}/{endpoint}",
                                     data=json.dumps({**body, "stream": stream}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = response.read().decode()
    except urllib.error.HTTPError as error:
        raise RequestError(f"HTTP {error.code}: {error.read().decode()}") from None
    except http.client.HTTPException as error:  # the server went mid-answer (IncompleteRead, ...)
        raise RequestError(f"HTTP answer cut off: {error!r}") from None
    if not stream:
        return [json.loads(payload)]
    return [json.loads(line[5:]) for line in payload.splitlines() if line.startswith("data:")]
