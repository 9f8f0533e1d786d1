"""`triton-vlm openai`: OpenAI's `/v1/chat/completions` and `/v1/models` (FastAPI on uvicorn) in
front of a running `ensemble`, reached over gRPC streaming.

Messages (string content, or `text`, `image_url` and `video_url` parts) go through the checkpoint's
chat template (`triton_vlm.clients.chat.render_chat`); media travel to the ensemble as the `data:` URLs
they came in, and any other URL is refused: this server fetches nothing. A client that goes away
(mid-stream or while waiting) cancels its gRPC stream, so the `llm` stops and frees its KV blocks.
The served ensemble's own media limits (its `preprocess` config, read at start-up) bound what is
read: a body larger than they allow is refused with 413 before it is parsed (`BodyLimit`), and a
request with more media parts than `max_media_items` with 400.
gRPC streaming carries an error's message but not its code, so errors are told apart by message:
overload refusals (UNAVAILABLE) -> 503, the pipeline's internal failures -> 500, the rest (what the
ensemble refuses as INVALID_ARG) -> 400, each in OpenAI's error format.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Awaitable, Iterator, Literal, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from triton_vlm.clients.body_limit import BodyLimit, body_limit_bytes
from triton_vlm.clients.chat import load_chat_template, render_chat
from triton_vlm.clients.client import Increment, RequestError, aio_channel, request_values, stream_generate
from triton_vlm.contract.limits import DEFAULT_LIMITS, Limits
from triton_vlm.errors import REFUSALS, RESTARTED, InvalidInput
from triton_vlm.families import detect_family

log = logging.getLogger("triton_vlm")

# Failures of the server rather than of the request: the ensemble's own, a dead model instance.
_INTERNAL = ("internal error", "is not healthy")
# Request fields this server cannot honour: refused unless they ask for nothing (0, false, empty).
_UNSUPPORTED = ("frequency_penalty", "presence_penalty", "logprobs", "logit_bias", "tools")
T = TypeVar("T")


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


class _URL(BaseModel):
    url: str


class _Text(BaseModel):
    type: Literal["text"]
    text: str


class _Image(BaseModel):
    type: Literal["image_url"]
    image_url: _URL


class _Video(BaseModel):
    type: Literal["video_url"]
    video_url: _URL


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[Annotated[_Text | _Image | _Video, Field(discriminator="type")]]


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    name: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: "text" (no guide), "json_object" (any JSON object: the guide
    type `json`), "json_schema" (its `json_schema.schema`: the guide type `json_schema`)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def guide(self) -> tuple[str | None, str | None]:
        """(guided_decoding_guide_type, guided_decoding_guide)."""
        if self.type == "json_schema":
            if self.json_schema is None:
                raise APIError(400, "response_format: json_schema is required with type json_schema",
                               param="response_format")
            return "json_schema", json.dumps(self.json_schema.schema_)
        return ("json", None) if self.type == "json_object" else (None, None)


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat completion request this server reads; others are ignored
    (`_UNSUPPORTED` ones are refused unless they ask for nothing). `top_k` and
    `repetition_penalty` are vLLM's extensions. Absent sampling fields are the ensemble's
    defaults: no temperature is greedy. `response_format` guides decoding (`ResponseFormat`)."""
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)  # the ensemble's UINT64
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None


def template_messages(messages: list[Message],
                      max_media_items: int) -> tuple[list[dict], list[bytes], list[bytes]]:
    """The messages as the chat template takes them (media parts as `{"type": "image"}` /
    `{"type": "video"}`), and the image and video `data:` URLs in order; at most
    `max_media_items` of them (the ensemble's limit)."""
    out, media = [], {"image": [], "video": []}
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        content = []
        for j, part in enumerate(message.content):
            if isinstance(part, _Text):
                content.append({"type": "text", "text": part.text})
                continue
            kind = "image" if isinstance(part, _Image) else "video"
            if len(media["image"]) + len(media["video"]) == max_media_items:
                raise APIError(400, f"messages[{i}].content[{j}]: more than {max_media_items} media parts in one "
                                    f"request (the served ensemble's max_media_items={max_media_items})",
                               param=f"messages[{i}].content[{j}]", code="too_many_media")
            url = (part.image_url if kind == "image" else part.video_url).url
            if not url.startswith("data:"):
                shown = url if len(url) <= 100 else url[:100] + "..."
                raise APIError(400, f"messages[{i}].content[{j}]: {kind}_url {shown!r} is not a data: URL; "
                                    "only data: URLs (base64) are accepted, nothing is fetched",
                               param=f"messages[{i}].content[{j}].{kind}_url", code="unsupported_url")
            media[kind].append(url.encode())
            content.append({"type": kind})
        out.append({"role": message.role, "content": content})
    return out, media["image"], media["video"]


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the HTTP client goes away first, `work` is cancelled (closing its gRPC
    stream) and the answer is a 499 that nobody reads."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise APIError(499, "the client closed the request")
    return task.result()


def served_limits(url: str) -> Limits:
    """The media limits of the `preprocess` model served at gRPC `url` (its config's parameters);
    the defaults, with a warning, when it cannot be asked."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        with grpcclient.InferenceServerClient(url) as client:
            config = client.get_model_config("preprocess", as_json=True, client_timeout=10)["config"]
    except InferenceServerException as error:
        log.warning("the media limits of %s could not be read (%s); using the defaults", url, error)
        return DEFAULT_LIMITS
    return Limits.from_params({k: v["string_value"] for k, v in config.get("parameters", {}).items()})


def create_app(url: str, checkpoint: str | Path, model_name: str | None = None,
               default_max_tokens: int = 512) -> FastAPI:
    """The ASGI app in front of the ensemble at gRPC `url`, for the model of `checkpoint`."""
    checkpoint = Path(checkpoint)
    family = detect_family(checkpoint)
    template = load_chat_template(checkpoint)
    if template is None:
        raise ValueError(f"{checkpoint}: no chat template (chat_template.jinja, chat_template.json or "
                         "tokenizer_config.json)")
    model_name = model_name or checkpoint.resolve().name
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.limits = await asyncio.to_thread(served_limits, url)
        async with aio_channel(url) as channel:
            app.state.channel = channel
            yield

    app = FastAPI(title="triton-vlm", lifespan=lifespan)
    app.state.limits = DEFAULT_LIMITS
    app.add_middleware(BodyLimit, max_bytes=lambda: body_limit_bytes(app.state.limits))

    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return APIError(400, f"{where}: {first['msg']}", param=where or None).response()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "triton-vlm"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        if body.model != model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        if body.n not in (None, 1):
            raise APIError(400, f"n: only 1 choice per request is supported, got {body.n}", param="n")
        for name in _UNSUPPORTED:
            if body.model_extra.get(name):
                raise APIError(400, f"{name}: not supported, got {body.model_extra[name]!r}", param=name)
        messages, images, videos = template_messages(body.messages, request.app.state.limits.max_media_items)
        try:
            prompt = render_chat(template, family, messages)
        except InvalidInput as error:
            raise APIError(400, str(error), param="messages") from None
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None),
                          default_max_tokens)
        guide_type, guide = body.response_format.guide() if body.response_format else (None, None)
        values = request_values(prompt, images, videos, max_tokens=max_tokens, temperature=body.temperature,
                                top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                                repetition_penalty=body.repetition_penalty, stream=bool(body.stream),
                                stop_words=[body.stop] if isinstance(body.stop, str) else body.stop,
                                guide_type=guide_type, guide=guide)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = stream_generate(request.app.state.channel, values, completion_id)
        head = {"id": completion_id, "created": int(time.time()), "model": model_name}
        if body.stream:
            # The first response is awaited here, so that a refusal is an HTTP error, not an event.
            first = await _unless_disconnected(request, _first(stream))
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_events(stream, first, head, usage), media_type="text/event-stream")
        increments = await _unless_disconnected(request, _collect(stream))
        return JSONResponse({**head, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "".join(i.text for i in increments)},
            "finish_reason": increments[-1].finish_reason, "logprobs": None}], "usage": _usage(increments)})

    return app


@contextlib.contextmanager
def _refusals_as_api_errors() -> Iterator[None]:
    try:
        yield
    except (RequestError, grpc.aio.AioRpcError) as error:
        raise ensemble_error(error) from None


async def _first(stream: AsyncIterator[Increment]) -> Increment:
    with _refusals_as_api_errors():
        increment = await anext(stream, None)
    if increment is None:
        raise APIError(500, "the ensemble ended the request without a response")
    return increment


async def _collect(stream: AsyncIterator[Increment]) -> list[Increment]:
    first = await _first(stream)
    with _refusals_as_api_errors():
        return [first] + [increment async for increment in stream]


def _usage(increments: list[Increment]) -> dict[str, int | None]:
    """Token counts: the prompt's as the ensemble expanded it (None where it does not report it)."""
    prompt = next((i.prompt_tokens for i in reversed(increments) if i.prompt_tokens is not None), None)
    completion = sum(len(i.output_ids) for i in increments)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": (prompt or 0) + completion}


async def _events(stream: AsyncIterator[Increment], first: Increment, head: dict[str, Any],
                  include_usage: bool) -> AsyncIterator[str]:
    """The SSE events of a streamed completion: the role, the text, the finish reason, the usage
    (`stream_options.include_usage`), `[DONE]`; an error past the first response is an `error`
    event. Starlette cancels this generator when the client goes away, which closes `stream` and
    so cancels the gRPC call."""
    def chunk(delta: dict | None, finish_reason: str | None = None, **usage: Any) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                              "logprobs": None}]
        extra = usage or ({"usage": None} if include_usage else {})
        return f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': choices, **extra})}\n\n"

    seen: list[Increment] = []
    async with contextlib.aclosing(stream):
        yield chunk({"role": "assistant", "content": ""})
        increment = first
        try:
            while increment is not None:
                seen.append(increment)
                if increment.text:
                    yield chunk({"content": increment.text})
                increment = await anext(stream, None)
        except (RequestError, grpc.aio.AioRpcError) as error:
            yield f"data: {json.dumps(ensemble_error(error).body())}\n\n"
            return
    yield chunk({}, seen[-1].finish_reason)
    if include_usage:
        yield chunk(None, usage=_usage(seen))
    yield "data: [DONE]\n\n"


def serve(url: str, checkpoint: str | Path, host: str = "127.0.0.1", port: int = 8080, model_name: str | None = None,
          default_max_tokens: int = 512) -> None:
    """Run the server in the foreground until SIGINT / SIGTERM (uvicorn's handling)."""
    import uvicorn

    uvicorn.run(create_app(url, checkpoint, model_name, default_max_tokens), host=host, port=port,
                log_level="info")
