"""`triton-vlm openai`: OpenAI's `/v1/chat/completions`, `/v1/completions` (the legacy text one) and
`/v1/models` (FastAPI on uvicorn) in front of a running `ensemble`, reached over gRPC streaming.

Every request field is honoured, accepted as a no-op, or refused with 400 naming it
(`triton_vlm.clients.openai_requests`); the answers are written by `openai_responses`.

Messages (string content, or `text`, `image_url` and `video_url` parts) go through the checkpoint's
chat template (`triton_vlm.clients.chat.render_chat`); media travel to the ensemble as the `data:` URLs
they came in, and any other URL is refused: this server fetches nothing. A client that goes away
(mid-stream or while waiting) cancels its gRPC stream, so the `llm` stops and frees its KV blocks.
The served ensemble's own media limits (its `preprocess` config, read at start-up) bound what is
read: a body larger than they allow is refused with 413 before it is parsed (`BodyLimit`), and a
request with more media parts than `max_media_items` with 400.
A text completion's prompt is sent as it is, without the chat template. A chat request's `tools`
go through the chat template too, and the answer's tool calls come back as `tool_calls`
(`triton_vlm.clients.tool_calls`; `openai_responses.ToolShape`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
import functools
from functools import partial
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Iterator, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from triton_vlm.clients.body_limit import BodyLimit, body_limit_bytes
from triton_vlm.clients.chat import check_tools, load_chat_template, render_chat
from triton_vlm.clients.client import aio_channel, stream_generate
from triton_vlm.clients.guided import Guide, InvalidRequestField
from triton_vlm.clients.openai_requests import (ChatRequest, CompletionRequest, ImagePart, Message, SamplingRequest,
                                                TextPart)
from triton_vlm.clients.openai_responses import APIError, Shape, TextShape, ToolShape, answer, collect, events, first
from triton_vlm.clients.tool_calls import forced_call_grammar
from triton_vlm.contract.limits import DEFAULT_LIMITS, Limits
from triton_vlm.contract.sampling import MAX_GUIDE_CHARS, xgrammar_message
from triton_vlm.errors import InvalidInput
from triton_vlm.families import detect_family
from triton_vlm.llm.config import DecoderConfig
from triton_vlm.tokenizer import load_tokenizer

log = logging.getLogger("triton_vlm")
T = TypeVar("T")


def template_messages(messages: list[Message],
                      max_media_items: int) -> tuple[list[dict], list[bytes], list[bytes]]:
    """The messages as the chat template takes them (media parts as `{"type": "image"}` /
    `{"type": "video"}`), and the image and video `data:` URLs in order; at most
    `max_media_items` of them (the ensemble's limit)."""
    out, media = [], {"image": [], "video": []}
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            out.append({"role": message.role, "content": message.content, **_tool_fields(message, i)})
            continue
        content = []
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart):
                content.append({"type": "text", "text": part.text})
                continue
            kind = "image" if isinstance(part, ImagePart) else "video"
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
        out.append({"role": message.role, "content": content, **_tool_fields(message, i)})
    return out, media["image"], media["video"]


def _tool_fields(message: Message, i: int) -> dict:
    """An assistant's `tool_calls` (each call's `arguments` JSON text as the object templates
    write out, as vLLM gives them) and a tool's `tool_call_id`, where the message has them."""
    fields: dict = {}
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            function = call.get("function") or {}
            if not isinstance(function, dict):
                raise APIError(400, f"messages[{i}].tool_calls[{j}].function: must be an object",
                               param=f"messages[{i}].tool_calls")
            function = dict(function)
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except (json.JSONDecodeError, RecursionError):
                    raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments: not JSON",
                                   param=f"messages[{i}].tool_calls") from None
            calls.append({**call, "function": function})
        fields["tool_calls"] = calls
    return fields


def _forced_grammar(tools: list, choice: str, tool_format: str) -> str:
    """`forced_call_grammar`, or InvalidRequestField naming `tools` where xgrammar cannot read a
    function's `parameters` or the grammar is longer than the ensemble takes (`MAX_GUIDE_CHARS`)."""
    try:
        grammar = forced_call_grammar(tools, choice, tool_format)
    except RuntimeError as error:  # xgrammar's
        raise InvalidRequestField("tools", f"a function's parameters: {xgrammar_message(error)}") from None
    if len(grammar) > MAX_GUIDE_CHARS:
        raise InvalidRequestField("tools", f"the forced call's grammar, {len(grammar)} characters, exceeds "
                                           f"max_guide_chars={MAX_GUIDE_CHARS}")
    return grammar


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
    tokenizer = load_tokenizer(checkpoint)  # (a token's text, in log-probabilities)
    vocab_size = DecoderConfig.from_checkpoint(checkpoint).vocab_size  # (the logits' width: `logit_bias`)
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
        problem = error.errors()[0]
        where = ".".join(str(p) for p in problem["loc"] if p != "body")
        return APIError(400, f"{where}: {problem['msg']}", param=where or None).response()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "triton-vlm"}]}

    @functools.lru_cache(maxsize=1 << 16)
    def token_text(token_id: int) -> str:  # (each alternative of each step decodes one id)
        return tokenizer.decode([token_id], skip_special_tokens=False)

    def served(body: SamplingRequest) -> None:
        if body.model != model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        body.refuse_unserved()

    async def complete(request: Request, values: dict[str, tuple], body: SamplingRequest, prefix: str,
                       shape: Callable[[int], Shape]) -> Response:
        completion_id = f"{prefix}-{uuid.uuid4().hex}"
        stream = stream_generate(request.app.state.channel, values, completion_id)
        head = {"id": completion_id, "created": int(time.time()), "model": model_name}
        if body.stream:
            head_increment = await _unless_disconnected(request, first(stream))
            return StreamingResponse(events(stream, head_increment, head, shape, body.n or 1, body.include_usage),
                                     media_type="text/event-stream")
        increments = await _unless_disconnected(request, collect(stream))
        return JSONResponse(answer(increments, head, shape))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        with _field_errors():
            served(body)
            messages, images, videos = template_messages(body.messages, request.app.state.limits.max_media_items)
            choice, tools = body.tool_choice_of(), body.tools or None
            try:
                if tools:
                    check_tools(template, family)
            except InvalidInput as error:
                raise APIError(400, str(error), param="tools") from None
            try:
                prompt = render_chat(template, family, messages, tools)
            except InvalidInput as error:
                raise APIError(400, str(error), param="messages") from None
            forced = None
            if choice not in ("auto", "none"):  # (off the event loop: other clients' streams go on)
                forced = Guide("tool_choice", "ebnf_grammar",
                               await asyncio.to_thread(_forced_grammar, tools, choice, family.prompt.tool_call_format))
            values = body.values(prompt, images, videos, default_max_tokens, forced) | body.bias_values(vocab_size)
        text = token_text if body.logprobs else None
        shape = partial(Shape, text) if choice == "none" else partial(
            ToolShape, text, family.prompt.tool_call_format, parallel=body.parallel_tool_calls is not False)
        return await complete(request, values, body, "chatcmpl", shape)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        with _field_errors():
            served(body)
            values = body.values(default_max_tokens) | body.bias_values(vocab_size)
        return await complete(request, values, body, "cmpl",
                              partial(TextShape, token_text if body.logprobs is not None else None))

    return app


@contextlib.contextmanager
def _field_errors() -> Iterator[None]:
    """A field refused by the request models as a 400 naming it."""
    try:
        yield
    except InvalidRequestField as error:
        raise APIError(400, str(error), param=error.param) from None


def serve(url: str, checkpoint: str | Path, host: str = "127.0.0.1", port: int = 8080, model_name: str | None = None,
          default_max_tokens: int = 512) -> None:
    """Run the server in the foreground until SIGINT / SIGTERM (uvicorn's handling)."""
    import uvicorn

    uvicorn.run(create_app(url, checkpoint, model_name, default_max_tokens), host=host, port=port,
                log_level="info")
