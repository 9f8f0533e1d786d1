"""The request bodies of the OpenAI-compatible server (`/v1/chat/completions`, `/v1/completions`)
and what each field does: every field is honoured, accepted as a no-op, or refused naming it.

- Honoured (typed fields of `ChatRequest` / `CompletionRequest`): mapped to the ensemble's inputs
  by `ensemble_values` (the ensemble checks their ranges), or read by the server (`model`,
  `messages`, `prompt`, `stream`, `stream_options`, `logprobs`).
- `NO_OPS`: accepted and unused, as vLLM does (it ignores them too): identifiers and hints for
  OpenAI's own platform.
- `ONLY`: accepted with the values listed (what asks for nothing, or what the server does anyway),
  refused otherwise; OpenAI's fields this server cannot honour and vLLM's extensions the ensemble
  has no control for.
- `response_format` and vLLM's `guided_*`: read by `guided.guided_decoding`, sent as the ensemble's
  constrained decoding inputs (`guided_decoding_guide_type`, `guided_decoding_guide`).
- Any other field (neither OpenAI's nor vLLM's) is refused: nothing is silently ignored.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from triton_vlm.clients.client import request_values
from triton_vlm.clients.guided import GUIDED_FIELDS, Guide, InvalidRequestField, guided_decoding
from triton_vlm.clients.tool_calls import tool_choice, tool_names
from triton_vlm.contract.sampling import MAX_GUIDE_CHARS, MAX_RETURN_SEQUENCES, MAX_TOP_LOG_PROBS

# Fields accepted and unused, on both endpoints.
NO_OPS = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key"})
# name -> (the values accepted, why no other): OpenAI's fields, then vLLM's extensions.
_COMMON: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "no ranking of extra sequences; ask for n of them with n"),
    "store": ((None, False), "nothing is stored"),
    "service_tier": ((None, "auto", "default"), "one service tier"),
    "use_beam_search": ((None, False), "no beam search"),
    "length_penalty": ((None, 1), "it applies to beam search, which is not supported"),
    "min_p": ((None, 0), "no min-p sampling"),
    "stop_token_ids": ((None, []), "stop words only"),
    "include_stop_str_in_output": ((None, False), "a stop word is never in the output"),
    "ignore_eos": ((None, False), "the eos ids always stop"),
    "skip_special_tokens": ((None, True), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((None, True), "the text is decoded one way"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated"),
    "prompt_logprobs": ((None,), "no prompt log-probabilities"),
    "allowed_token_ids": ((None,), "no allow-list of tokens"),
    "logits_processors": ((None,), "no custom logits processors"),
    "return_tokens_as_token_ids": ((None, False), "tokens are returned as text"),
    "priority": ((None, 0), "no priority scheduling"),
    "request_id": ((None,), "the server names its requests"),
    "cache_salt": ((None,), "no salted prefix cache"),
    "kv_transfer_params": ((None,), "no disaggregated serving"),
    "vllm_xargs": ((None,), "no custom extensions"),
    "structural_tag": ((None,), "no structural tags (constraints: response_format, guided_json, guided_regex, "
                               "guided_choice, guided_grammar)"),
    "guided_decoding_backend": ((None, "xgrammar"), "the llm constrains decoding with xgrammar"),
    "guided_whitespace_pattern": ((None,), "JSON is constrained compact, with no free whitespace"),
}
CHAT_ONLY = {**_COMMON,
             "modalities": ((None, ["text"]), "text output only"),
             "audio": ((None,), "no audio output"),
             "prediction": ((None,), "no predicted outputs"),
             "web_search_options": ((None,), "no web search"),
             "reasoning_effort": ((None,), "no reasoning control"),
             "verbosity": ((None,), "no verbosity control"),
             "moderation": ((None,), "no moderation"),
             "prompt_cache_options": ((None,), "no prompt-cache breakpoints"),
             "prompt_cache_retention": ((None,), "no prompt-cache retention policy"),
             "functions": ((None, []), "deprecated: send tools"),
             "function_call": ((None, "none"), "deprecated: send tool_choice"),
             "echo": ((None, False), "the answer never repeats the last message"),
             "add_generation_prompt": ((None, True), "the chat template always adds the generation prompt"),
             "continue_final_message": ((None, False), "the last message is never continued"),
             "add_special_tokens": ((None, False), "the chat template writes the special tokens"),
             "documents": ((None,), "no documents for the chat template"),
             "chat_template": ((None,), "the checkpoint's chat template only"),
             "chat_template_kwargs": ((None,), "the checkpoint's chat template only, as it is"),
             "mm_processor_kwargs": ((None,), "the served preprocess's settings only")}
COMPLETION_ONLY = {**_COMMON,
                   "echo": ((None, False), "the answer never repeats the prompt"),
                   "suffix": ((None,), "no insertion after a suffix")}


def _same(value: Any, accepted: Any) -> bool:
    """Equal, and a bool only where a bool is accepted (JSON's true is not 1)."""
    return isinstance(value, bool) == isinstance(accepted, bool) and value == accepted


class _URL(BaseModel):
    url: str


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: _URL


class VideoPart(BaseModel):
    type: Literal["video_url"]
    video_url: _URL


class Message(BaseModel):
    """A chat message; an assistant's may carry the tool calls it made (`tool_calls`, content then
    optional), a tool's answers one of them (`tool_call_id`)."""
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = False
    include_obfuscation: Literal[False] | None = None  # (no obfuscation is added to the events)


class SamplingRequest(BaseModel):
    """The fields both endpoints honour. Absent sampling fields are the ensemble's defaults: no
    temperature is greedy. `top_k`, `repetition_penalty`, `min_tokens` and `bad_words` are vLLM's."""
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)  # the ensemble's UINT64
    n: int | None = Field(None, ge=1, le=MAX_RETURN_SEQUENCES)  # the ensemble's `num_return_sequences`
    stop: str | list[str] | None = None
    bad_words: list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # sent as the ensemble's `embedding_bias` (`bias_values`)
    # constrained decoding, read by `guided.guided_decoding`
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    only: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {}

    def refuse_unserved(self) -> None:
        """InvalidRequestField for the first field sent that is neither honoured, a no-op, nor an
        accepted value of `only`; `stream_options` without `stream` (as vLLM and OpenAI refuse it)."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestField("stream_options", "only with stream true")
        for name, value in (self.model_extra or {}).items():
            if name in NO_OPS:
                continue
            if name not in self.only:
                raise InvalidRequestField(name, "not a field of OpenAI's request nor of vLLM's; refused, not ignored")
            accepted, why = self.only[name]
            if not any(_same(value, a) for a in accepted):
                shown = " or ".join("null" if a is None else repr(a) for a in accepted)
                raise InvalidRequestField(name, f"{value!r} is not supported ({why}); send {shown} or leave it out")

    def bias_values(self, vocab_size: int) -> dict[str, tuple]:
        """`logit_bias` (token id -> bias in [-100, 100], as OpenAI bounds it) as the ensemble's
        `embedding_bias`: one value per token of the model's vocabulary, 0 where none is given."""
        if not self.logit_bias:
            return {}
        bias = np.zeros(vocab_size, np.float32)
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size or not -100 <= value <= 100:
                raise InvalidRequestField("logit_bias", f"{key!r}: {value!r}: keys are token ids in [0, {vocab_size}), "
                                          "values biases in [-100, 100]")
            bias[int(key)] = value
        return {"embedding_bias": (bias, "FP32")}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def ensemble_values(self, prompt: str, images: list[bytes], videos: list[bytes], max_tokens: int,
                        logprobs: bool, top_logprobs: int | None, forced: Guide | None = None) -> dict[str, tuple]:
        """The ensemble's inputs (`client.request_values`) for this request, with the endpoint's
        `max_tokens`, `logprobs` (whether to return the chosen tokens' log-probabilities) and
        `top_logprobs` (how many alternatives), and a constraint the server `forced` (a required
        tool call), which no other may join."""
        guide = guided_decoding({name: getattr(self, name) for name in ("response_format", *GUIDED_FIELDS)})
        if forced is not None and guide is not None:
            raise InvalidRequestField(forced.param, f"one constraint per request, and {guide.param} sets one")
        guide = forced or guide
        return request_values(prompt, images, videos, max_tokens=max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens,
                              stop_words=[self.stop] if isinstance(self.stop, str) else self.stop,
                              bad_words=self.bad_words, stream=bool(self.stream),
                              return_log_probs=True if logprobs else None, num_top_log_probs=top_logprobs or None,
                              num_return_sequences=self.n if self.n != 1 else None, guide_type=guide and guide.guide_type,
                              guide=guide and guide.guide)


class ChatRequest(SamplingRequest):
    only: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = CHAT_ONLY
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOG_PROBS)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: an answer's first call only

    def tool_choice_of(self) -> str:
        """`tool_calls.tool_choice` of the request's tools, or InvalidRequestField naming the field.
        The tools are bounded as a guide is (`MAX_GUIDE_CHARS`): a forced call's grammar is made of them."""
        try:
            tool_names(self.tools or [])
        except ValueError as error:
            raise InvalidRequestField("tools", str(error)) from None
        if self.tools and len(json.dumps(self.tools)) > MAX_GUIDE_CHARS:
            raise InvalidRequestField("tools", f"{len(json.dumps(self.tools))} characters of JSON exceed "
                                               f"max_guide_chars={MAX_GUIDE_CHARS}")
        try:
            return tool_choice(self.tool_choice, self.tools or [])
        except ValueError as error:
            raise InvalidRequestField("tool_choice", str(error)) from None

    def values(self, prompt: str, images: list[bytes], videos: list[bytes], default_max_tokens: int,
               forced: Guide | None = None) -> dict[str, tuple]:
        """The ensemble's inputs for the rendered `prompt` and the messages' media."""
        max_tokens = next((m for m in (self.max_completion_tokens, self.max_tokens) if m is not None),
                          default_max_tokens)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestField("top_logprobs", "only with logprobs true")
        return self.ensemble_values(prompt, images, videos, max_tokens, bool(self.logprobs), self.top_logprobs,
                                    forced)


class CompletionRequest(SamplingRequest):
    only: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = COMPLETION_ONLY
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOG_PROBS)  # the alternatives per token

    def values(self, default_max_tokens: int) -> dict[str, tuple]:
        """The ensemble's inputs: the one prompt as it is (no chat template)."""
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise InvalidRequestField("prompt", f"one prompt per request, got a list of {len(self.prompt)}")
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return self.ensemble_values(prompt, [], [], max_tokens, self.logprobs is not None, self.logprobs)
