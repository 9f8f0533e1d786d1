"""The OpenAI-compatible server's answers: errors in OpenAI's format, and a completion (chat's or
the legacy text one's) from the ensemble's responses, whole or as server-sent events.

Both endpoints share the collection and the streaming; a `Shape` writes what differs, the choice
(chat with tools: `ToolShape`, its tool calls parsed out of the answer).
Log-probabilities are the ensemble's `output_log_probs` (each chosen token's) and, where asked,
`top_log_probs` / `top_log_prob_ids` (the most likely tokens at each step); a token's text is its
id decoded alone (a token holding part of a UTF-8 character decodes to U+FFFD). A request for `n`
choices is one ensemble request with `num_return_sequences` n; each response's `sequence_index`
is its choice's index.
gRPC streaming carries an error's message but not its code, so errors are told apart by message:
overload refusals (UNAVAILABLE) -> 503, the pipeline's internal failures -> 500, the rest (what the
ensemble refuses as INVALID_ARG) -> 400.
"""
from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator, Callable, Iterator

import grpc
from fastapi.responses import JSONResponse

from triton_vlm.clients.client import Increment, RequestError
from triton_vlm.clients.tool_calls import ToolCallError, ToolCallStream, parse_tool_calls
from triton_vlm.errors import REFUSALS, RESTARTED

# Failures of the server rather than of the request: the ensemble's own, a dead model instance.
_INTERNAL = ("internal error", "is not healthy")


class APIError(Exception):
    """A request answered with an error in OpenAI's format."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def ensemble_error(error: RequestError | grpc.aio.AioRpcError) -> APIError:
    """The HTTP answer to an ensemble's refusal (by its message) or a gRPC transport failure (by code)."""
    if isinstance(error, grpc.aio.AioRpcError):
        status = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAVAILABLE: 503}.get(error.code(), 500)
        return APIError(status, f"ensemble: {error.details()}")
    message = str(error)
    if RESTARTED in message:  # a step died under the request, or is being reloaded
        return APIError(503, message, code="step_restarted")
    if any(m in message for m in REFUSALS):  # overload: the pipeline's and Triton's queues'
        return APIError(503, message, code="server_busy")
    return APIError(500 if any(m in message for m in _INTERNAL) else 400, message)


Logprobs = tuple[list[float], list[list[tuple[int, float]]] | None]  # per token: its own, its top alternatives


def _alternatives(increments: list[Increment]) -> Logprobs | None:
    """The increments' log-probabilities: each token's and (where asked) its top (id, logprob) pairs."""
    if all(i.logprobs is None for i in increments):
        return None
    top = None if all(i.top_logprobs is None for i in increments) else \
        [t for i in increments for t in i.top_logprobs or []]
    return [p for i in increments for p in i.logprobs or []], top


class Shape:
    """How chat completions write one choice (`index`); `token_text` decodes one token id, None
    where the request asks for no log-probabilities."""
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, token_text: Callable[[int], str] | None, index: int = 0) -> None:
        self.token_text, self.index = token_text, index

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = self.token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def logprobs(self, ids: list[int], logprobs: Logprobs | None) -> dict | None:
        if self.token_text is None:
            return None
        chosen, top = logprobs or ([], None)
        return {"content": [{**self._entry(t, p), "top_logprobs": [self._entry(*a) for a in top[k]] if top else []}
                            for k, (t, p) in enumerate(zip(ids, chosen))]}

    def choice(self, text: str, ids: list[int], logprobs: Logprobs | None, finish_reason: str | None) -> dict:
        return {"index": self.index, "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason, "logprobs": self.logprobs(ids, logprobs)}

    def delta(self, text: str, ids: list[int], logprobs: Logprobs | None, finish_reason: str | None) -> dict:
        """A streamed choice: new text, or the last one (an empty delta) with the finish reason."""
        return {"index": self.index, "delta": {"content": text} if ids or finish_reason is None else {},
                "finish_reason": finish_reason, "logprobs": self.logprobs(ids, logprobs) if ids else None}

    def opening(self) -> dict | None:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                "logprobs": None}


class ToolShape(Shape):
    """Chat completions of a request with tools: the answer's tool calls (`tool_calls`, in the
    family's `tool_format`) as the message's `tool_calls` and finish reason "tool_calls", the text
    before them its content; streamed, the content as it comes and the calls with the last chunk.
    An answer whose calls do not parse is all content."""

    def __init__(self, token_text: Callable[[int], str] | None, tool_format: str, index: int = 0,
                 parallel: bool = True) -> None:
        super().__init__(token_text, index)
        self.stream = ToolCallStream(tool_format)
        self.parallel = parallel  # `parallel_tool_calls`; false: the first call only

    def _calls(self, calls: list) -> list:
        return calls if self.parallel else calls[:1]

    def choice(self, text: str, ids: list[int], logprobs: Logprobs | None, finish_reason: str | None) -> dict:
        try:
            content, calls = parse_tool_calls(text, self.stream.format)
        except ToolCallError:
            content, calls = text, []
        calls = self._calls(calls)
        message = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"], finish_reason = [c.as_openai() for c in calls], "tool_calls"
        return {"index": self.index, "message": message, "finish_reason": finish_reason,
                "logprobs": self.logprobs(ids, logprobs)}

    def delta(self, text: str, ids: list[int], logprobs: Logprobs | None, finish_reason: str | None) -> dict:
        if finish_reason is None:
            return super().delta(self.stream.feed(text), ids, logprobs, None)
        try:
            rest, calls = self.stream.finish()
        except ToolCallError:
            rest, calls = self.stream.text[self.stream.sent:], []
        calls = self._calls(calls)
        delta: dict[str, Any] = {"content": rest} if rest else {}
        if calls:
            delta["tool_calls"], finish_reason = [c.as_openai(i) for i, c in enumerate(calls)], "tool_calls"
        return {"index": self.index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}


class TextShape(Shape):
    """How text completions (`/v1/completions`) write a choice; `text_offset` counts from the
    completion's start, across a stream's chunks. A token's `top_logprobs` holds the top
    alternatives asked for and the chosen token (vLLM's)."""
    object = chunk_object = "text_completion"

    def __init__(self, token_text: Callable[[int], str] | None, index: int = 0) -> None:
        super().__init__(token_text, index)
        self.offset = 0

    def logprobs(self, ids: list[int], logprobs: Logprobs | None) -> dict | None:
        if self.token_text is None:
            return None
        chosen, top = logprobs or ([], None)
        tokens, offsets = [self.token_text(i) for i in ids], []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        alternatives = [{**{self.token_text(t): lp for t, lp in (top[k] if top else [])}, token: p}
                        for k, (token, p) in enumerate(zip(tokens, chosen))]
        return {"tokens": tokens, "token_logprobs": list(chosen), "top_logprobs": alternatives,
                "text_offset": offsets}

    def choice(self, text: str, ids: list[int], logprobs: Logprobs | None, finish_reason: str | None) -> dict:
        return {"index": self.index, "text": text, "finish_reason": finish_reason,
                "logprobs": self.logprobs(ids, logprobs)}

    def delta(self, text: str, ids: list[int], logprobs: Logprobs | None, finish_reason: str | None) -> dict:
        return {"index": self.index, "text": text, "finish_reason": finish_reason,
                "logprobs": self.logprobs(ids, logprobs) if ids else None}

    def opening(self) -> dict | None:
        return None


@contextlib.contextmanager
def _refusals_as_api_errors() -> Iterator[None]:
    try:
        yield
    except (RequestError, grpc.aio.AioRpcError) as error:
        raise ensemble_error(error) from None


async def first(stream: AsyncIterator[Increment]) -> Increment:
    """The stream's first response, awaited so that a refusal is an HTTP error, not an event."""
    with _refusals_as_api_errors():
        increment = await anext(stream, None)
    if increment is None:
        raise APIError(500, "the ensemble ended the request without a response")
    return increment


async def collect(stream: AsyncIterator[Increment]) -> list[Increment]:
    head = await first(stream)
    with _refusals_as_api_errors():
        return [head] + [increment async for increment in stream]


def usage(increments: list[Increment]) -> dict[str, int | None]:
    """Token counts: the prompt's as the ensemble expanded it (None where it does not report it)."""
    prompt = next((i.prompt_tokens for i in reversed(increments) if i.prompt_tokens is not None), None)
    completion = sum(len(i.output_ids) for i in increments)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": (prompt or 0) + completion}


def _by_choice(increments: list[Increment]) -> dict[int, list[Increment]]:
    choices: dict[int, list[Increment]] = {}
    for increment in increments:
        choices.setdefault(increment.sequence_index, []).append(increment)
    return dict(sorted(choices.items()))


def answer(increments: list[Increment], head: dict[str, Any], shape: Callable[[int], Shape]) -> dict:
    """The whole completion, as one JSON body: a choice per sequence (`shape(index)` writes it)."""
    choices = []
    for index, own in _by_choice(increments).items():
        text, ids = "".join(i.text for i in own), [t for i in own for t in i.output_ids]
        choices.append(shape(index).choice(text, ids, _alternatives(own), own[-1].finish_reason))
    return {**head, "object": shape(0).object, "usage": usage(increments), "choices": choices}


async def events(stream: AsyncIterator[Increment], head_increment: Increment, head: dict[str, Any],
                 shape: Callable[[int], Shape], n: int, include_usage: bool) -> AsyncIterator[str]:
    """The SSE events of a streamed completion of `n` choices (`shape(index)` writes one): the
    openings (chat's role), the text as each sequence's responses come, each choice's finish
    reason, the usage (`stream_options.include_usage`), `[DONE]`; an error past the first response
    is an `error` event. Starlette cancels this generator when the client goes away, which closes
    `stream` and so cancels the gRPC call."""
    shapes = [shape(index) for index in range(n)]

    def chunk(choice: dict | None, **totals: Any) -> str:
        extra = totals or ({"usage": None} if include_usage else {})
        body = {**head, "object": shapes[0].chunk_object, "choices": [] if choice is None else [choice], **extra}
        return f"data: {json.dumps(body)}\n\n"

    seen: list[Increment] = []
    async with contextlib.aclosing(stream):
        for opening in (s.opening() for s in shapes):
            if opening is not None:
                yield chunk(opening)
        increment: Increment | None = head_increment
        try:
            while increment is not None:
                seen.append(increment)
                if increment.text or (shapes[0].token_text is not None and increment.output_ids):
                    yield chunk(shapes[increment.sequence_index].delta(
                        increment.text, increment.output_ids, _alternatives([increment]), None))
                increment = await anext(stream, None)
        except (RequestError, grpc.aio.AioRpcError) as error:
            yield f"data: {json.dumps(ensemble_error(error).body())}\n\n"
            return
    for index, own in _by_choice(seen).items():
        yield chunk(shapes[index].delta("", [], None, own[-1].finish_reason))
    if include_usage:
        yield chunk(None, usage=usage(seen))
    yield "data: [DONE]\n\n"
