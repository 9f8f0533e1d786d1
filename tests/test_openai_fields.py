"""Every field of the `openai` package's request types (chat completions and text completions) is
honoured, accepted as a named no-op, or refused with 400 naming it: checked in process (FastAPI's
TestClient against `create_app`) with the ensemble's stream stubbed here only, so that what each
request sends the ensemble can be read. tests/test_openai.py drives the real server end to end.

Also the mapping of `response_format` and vLLM's `guided_*` fields to the ensemble's constrained
decoding inputs (`triton_vlm.clients.guided`), each guide compiled by xgrammar where it is there.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np
import pytest
from fastapi.testclient import TestClient
from openai.types import completion_create_params as text_params
from openai.types.chat import completion_create_params as chat_params

from triton_vlm.clients import openai_server
from triton_vlm.clients.client import Increment
from triton_vlm.clients.guided import Guide, InvalidRequestField, guided_decoding

MODEL = "tiny"
LOGPROBS = [-0.5, -1.25, -2.0]


def fields(*typed_dicts: type) -> set[str]:
    """The field names of TypedDicts, inherited ones included."""
    return {name for t in typed_dicts for k in t.__mro__ for name in getattr(k, "__annotations__", {})}


CHAT_FIELDS = fields(chat_params.CompletionCreateParamsBase, chat_params.CompletionCreateParamsStreaming,
                     chat_params.CompletionCreateParamsNonStreaming)
TEXT_FIELDS = fields(text_params.CompletionCreateParamsBase, text_params.CompletionCreateParamsStreaming,
                     text_params.CompletionCreateParamsNonStreaming)


@pytest.fixture(scope="module")
def app(tiny_checkpoint):
    return openai_server.create_app("127.0.0.1:1", tiny_checkpoint, MODEL, default_max_tokens=9)


@pytest.fixture
def api(app, monkeypatch):
    """A TestClient, and the ensemble inputs of each request it sends (`sent`, scalars unwrapped);
    the stub answers "Hel" "lo" in two responses, with log-probabilities where asked."""
    sent: list[dict[str, Any]] = []

    async def stream_generate(_channel, values: dict[str, tuple], _request_id: str = ""):
        sent.append({k: (v.tolist() if k in ("stop_words", "bad_words", "images", "videos")
                         else v if k == "embedding_bias" else v.item()) for k, (v, _) in values.items()})
        asked = "return_log_probs" in values
        top = int(values["num_top_log_probs"][0][0]) if "num_top_log_probs" in values else 0
        n = int(values["num_return_sequences"][0][0]) if "num_return_sequences" in values else 1
        for index in range(n):
            yield Increment("Hel", [11, 12], "", None, LOGPROBS[:2] if asked else None, _top(top, 2), index)
            yield Increment("lo", [13], "length", 7, LOGPROBS[2:] if asked else None, _top(top, 1), index)

    monkeypatch.setattr(openai_server, "stream_generate", stream_generate)
    app.state.channel = None  # (the lifespan, which opens the channel, does not run)
    client = TestClient(app)
    client.sent = sent
    return client


def _top(k: int, tokens: int) -> list[list[tuple[int, float]]] | None:
    """The stub's alternatives: ids 20, 21, ... with log-probabilities -0.25, -0.5, ..."""
    return [[(20 + j, -0.25 * (j + 1)) for j in range(k)] for _ in range(tokens)] if k else None


def _chat(api, **extra) -> tuple[Any, dict | None]:
    response = api.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                      **extra})
    return response, (api.sent[-1] if api.sent and response.status_code == 200 else None)


def _text(api, **extra) -> tuple[Any, dict | None]:
    response = api.post("/v1/completions", json={"model": MODEL, "prompt": "Once", **extra})
    return response, (api.sent[-1] if api.sent and response.status_code == 200 else None)


def _events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# name -> (a value other than the default, what the ensemble receives or the answer shows)
Check = Callable[[dict, Any], bool]
HONOURED: dict[str, tuple[Any, Check]] = {
    "model": (MODEL, lambda sent, r: r.json()["model"] == MODEL),
    "messages": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                 lambda sent, r: "Be brief." in sent["text_input"].decode()),
    "max_tokens": (5, lambda sent, r: sent["max_tokens"] == 5),
    "max_completion_tokens": (6, lambda sent, r: sent["max_tokens"] == 6),
    "temperature": (0.5, lambda sent, r: sent["temperature"] == 0.5),
    "top_p": (0.5, lambda sent, r: sent["top_p"] == 0.5),
    "seed": (7, lambda sent, r: sent["seed"] == 7),
    "stop": (["x", "y"], lambda sent, r: sent["stop_words"] == [b"x", b"y"]),
    "presence_penalty": (0.5, lambda sent, r: sent["presence_penalty"] == 0.5),
    "frequency_penalty": (-0.5, lambda sent, r: sent["frequency_penalty"] == -0.5),
    "stream": (True, lambda sent, r: sent["stream"] is True and _events(r)[-1]["choices"][0]["finish_reason"]),
    "stream_options": ({"include_usage": True},
                       lambda sent, r: _events(r)[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 3,
                                                                   "total_tokens": 10}),
    "logprobs": (True, lambda sent, r: sent["return_log_probs"] is True
                 and [c["logprob"] for c in r.json()["choices"][0]["logprobs"]["content"]] == LOGPROBS),
    "logit_bias": ({"42": 5, "7": -100}, lambda sent, r: _bias(sent) == {42: 5.0, 7: -100.0}),
    # (false keeps an answer's first tool call: test_tool_calls.py)
    "parallel_tool_calls": (False, lambda sent, r: r.json()["choices"][0]["message"]["content"] == "Hello"),
    "n": (2, lambda sent, r: sent["num_return_sequences"] == 2
          and [(c["index"], c["message"]["content"]) for c in r.json()["choices"]] == [(0, "Hello"), (1, "Hello")]),
    "response_format": ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
                        lambda sent, r: _guide(sent) == ("json_schema", '{"type": "object"}')),
}
# vLLM's extensions the ensemble has a control for
VLLM_HONOURED: dict[str, tuple[Any, Check]] = {
    "top_k": (3, lambda sent, r: sent["top_k"] == 3),
    "repetition_penalty": (1.5, lambda sent, r: sent["repetition_penalty"] == 1.5),
    "min_tokens": (2, lambda sent, r: sent["min_tokens"] == 2),
    "bad_words": (["no"], lambda sent, r: sent["bad_words"] == [b"no"]),
    "guided_json": ({"type": "object"}, lambda sent, r: _guide(sent) == ("json_schema", '{"type": "object"}')),
    "guided_regex": ("a+", lambda sent, r: _guide(sent) == ("regex", "a+")),
    "guided_choice": (["a", "b"], lambda sent, r: _guide(sent) == ("ebnf_grammar", 'root ::= "a" | "b"')),
    "guided_grammar": ('root ::= "a"', lambda sent, r: _guide(sent) == ("ebnf_grammar", 'root ::= "a"')),
}


def _bias(sent: dict) -> dict[int, float]:
    """The nonzero entries of the `embedding_bias` the ensemble received."""
    bias = sent["embedding_bias"]
    return {int(i): float(bias[i]) for i in np.flatnonzero(bias)}


def _guide(sent: dict) -> tuple[str | None, str | None]:
    """The constrained decoding inputs the ensemble received: (guide type, guide)."""
    return tuple(sent[k].decode() if k in sent else None
                 for k in ("guided_decoding_guide_type", "guided_decoding_guide"))
# accepted and unused, as vLLM does; the request is the plain one
NO_OPS = {"user": "u-1", "metadata": {"k": "v"}, "safety_identifier": "h", "prompt_cache_key": "k",
          "store": False, "service_tier": "auto"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REFUSED = {
    "top_logprobs": 2,  # (without logprobs: honoured with it, test_chat_top_logprobs_...)
    "tools": [TOOL], "tool_choice": "auto",
    "functions": [TOOL["function"]], "function_call": "auto", "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "reasoning_effort": "low", "verbosity": "low", "moderation": {"model": "m"},
    "prompt_cache_options": {"mode": "explicit"}, "prompt_cache_retention": "24h",
}
VLLM_REFUSED = {
    "min_p": 0.1, "best_of": 2, "use_beam_search": True, "length_penalty": 0.5, "stop_token_ids": [5],
    "include_stop_str_in_output": True, "ignore_eos": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 4, "prompt_logprobs": 1,
    "allowed_token_ids": [1], "logits_processors": ["m.P"], "return_tokens_as_token_ids": True, "priority": 1,
    "request_id": "r", "cache_salt": "s", "kv_transfer_params": {}, "vllm_xargs": {"a": 1},
    "structural_tag": "{}", "guided_decoding_backend": "outlines", "guided_whitespace_pattern": " ",
    "echo": True, "add_generation_prompt": False, "continue_final_message": True, "add_special_tokens": True,
    "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ x }}", "chat_template_kwargs": {"a": 1},
    "mm_processor_kwargs": {"fps": 1},
}
# The refused ones with a value that asks for nothing (or what the server does anyway): accepted.
ACCEPTED_DEFAULTS = {"top_logprobs": 0, "tools": [], "tool_choice": "none",
                     "modalities": ["text"], "service_tier": "default", "min_p": 0, "best_of": 1, "length_penalty": 1,
                     "stop_token_ids": [], "skip_special_tokens": True, "ignore_eos": False, "echo": False,
                     "add_generation_prompt": True, "priority": 0, "audio": None, "function_call": "none",
                     "guided_decoding_backend": "xgrammar"}


def _value(name: str, honoured: dict[str, tuple[Any, Check]], no_ops: dict[str, Any], refused: dict[str, Any]) -> Any:
    return honoured[name][0] if name in honoured else {**no_ops, **refused}[name]


def test_every_field_of_the_openai_chat_request_is_classified():
    tables = (HONOURED, NO_OPS, REFUSED)
    assert all(sum(name in t for t in tables) == 1 for name in CHAT_FIELDS), \
        sorted(n for n in CHAT_FIELDS if sum(n in t for t in tables) != 1)
    assert not set().union(*tables) - CHAT_FIELDS


@pytest.mark.parametrize("name", sorted(CHAT_FIELDS))
def test_each_chat_field_is_honoured_or_refused_by_name(api, name):
    _check_field(_chat, api, name, HONOURED, REFUSED)


def _check_field(call: Callable, api, name: str, honoured: dict[str, tuple[Any, Check]], refused: dict[str, Any]) -> None:
    """`name` sent with a value of its table: refused naming it, a no-op (the plain request sent),
    or honoured as its table's check says."""
    extra = {name: _value(name, honoured, NO_OPS, refused)}
    if name in ("stream_options", "stream"):
        extra.update(stream=True)
    response, sent = call(api, **extra)
    if name in refused:
        _expect_refused(response, name)
        return
    assert response.status_code == 200, response.text
    if name in NO_OPS:
        assert sent == call(api)[1]
    else:
        assert honoured[name][1](sent, response), (sent, response.text)


@pytest.mark.parametrize("name", sorted(VLLM_HONOURED) + sorted(VLLM_REFUSED))
def test_each_vllm_extension_is_honoured_or_refused_by_name(api, name):
    if name in VLLM_REFUSED:
        _expect_refused(_chat(api, **{name: VLLM_REFUSED[name]})[0], name)
        return
    value, check = VLLM_HONOURED[name]
    response, sent = _chat(api, **{name: value})
    assert response.status_code == 200 and check(sent, response), response.text


@pytest.mark.parametrize("name", sorted(ACCEPTED_DEFAULTS))
def test_a_refused_field_that_asks_for_nothing_is_accepted(api, name):
    response, sent = _chat(api, **{name: ACCEPTED_DEFAULTS[name]})
    assert response.status_code == 200, response.text
    assert sent == _chat(api)[1]


def _expect_refused(response, name: str) -> None:
    assert response.status_code == 400, (name, response.text)
    error = response.json()["error"]
    assert error["param"] == name and error["message"].startswith(f"{name}: ") \
        and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize("call", [_chat, _text])
def test_an_unknown_field_is_refused_not_ignored(api, call):
    response, _ = call(api, temprature=0.5)
    _expect_refused(response, "temprature")
    assert "refused, not ignored" in response.json()["error"]["message"]


def test_json_modes_reach_the_ensemble_and_stream_options_without_a_stream_are_refused_by_name(api):
    for form, guide in (({"type": "json_object"}, ("json", None)),
                        ({"type": "json_schema", "json_schema": {"name": "n", "schema": {}}}, ("json_schema", "{}"))):
        response, sent = _chat(api, response_format=form)
        assert response.status_code == 200 and _guide(sent) == guide, response.text
    response, sent = _chat(api, response_format={"type": "text"})
    assert response.status_code == 200 and _guide(sent) == (None, None)
    _expect_refused(_chat(api, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})[0],
                    "stream_options.continuous_usage_stats")
    _expect_refused(_chat(api, stream_options={"include_usage": True})[0], "stream_options")
    _expect_refused(_text(api, stream=False, stream_options={"include_usage": True})[0], "stream_options")


def test_chat_logprobs_are_the_ensembles_with_each_tokens_text(api, tiny_checkpoint):
    from triton_vlm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_checkpoint)
    response, sent = _chat(api, logprobs=True, top_logprobs=0)
    content = response.json()["choices"][0]["logprobs"]["content"]
    tokens = [tokenizer.decode([i], skip_special_tokens=False) for i in (11, 12, 13)]
    assert content == [{"token": t, "logprob": p, "bytes": list(t.encode()), "top_logprobs": []}
                       for t, p in zip(tokens, LOGPROBS)]
    assert _chat(api)[0].json()["choices"][0]["logprobs"] is None
    streamed = _events(_chat(api, logprobs=True, stream=True)[0])
    assert [c["logprob"] for e in streamed for ch in e["choices"] for c in (ch["logprobs"] or {}).get("content", [])] \
        == LOGPROBS


def test_chat_top_logprobs_are_each_tokens_alternatives(api, tiny_checkpoint):
    from triton_vlm.tokenizer import load_tokenizer

    text = load_tokenizer(tiny_checkpoint).decode
    response, sent = _chat(api, logprobs=True, top_logprobs=2)
    assert sent["num_top_log_probs"] == 2 and sent["return_log_probs"] is True
    alternatives = [{"token": text([20 + j], skip_special_tokens=False), "logprob": -0.25 * (j + 1),
                     "bytes": list(text([20 + j], skip_special_tokens=False).encode())} for j in range(2)]
    assert [c["top_logprobs"] for c in response.json()["choices"][0]["logprobs"]["content"]] == [alternatives] * 3
    streamed = _events(_chat(api, logprobs=True, top_logprobs=2, stream=True)[0])
    assert [c["top_logprobs"] for e in streamed for ch in e["choices"]
            for c in (ch["logprobs"] or {}).get("content", [])] == [alternatives] * 3
    _expect_refused(_chat(api, logprobs=True, top_logprobs=21)[0], "top_logprobs")


def test_n_choices_stream_each_with_its_index(api):
    events = _events(_chat(api, n=3, stream=True)[0])
    openings = [c["index"] for e in events for c in e["choices"] if c["delta"].get("role")]
    text = {i: "".join(c["delta"].get("content") or "" for e in events for c in e["choices"] if c["index"] == i)
            for i in range(3)}
    ends = [(c["index"], c["finish_reason"]) for e in events for c in e["choices"] if c["finish_reason"]]
    assert openings == [0, 1, 2] and text == {0: "Hello", 1: "Hello", 2: "Hello"}
    assert ends == [(0, "length"), (1, "length"), (2, "length")]
    _expect_refused(_chat(api, n=17)[0], "n")


# ---- /v1/completions -----------------------------------------------------------------------------
TEXT_HONOURED: dict[str, tuple[Any, Check]] = {
    "model": (MODEL, lambda sent, r: r.json()["model"] == MODEL),
    "prompt": ("Twice", lambda sent, r: sent["text_input"] == b"Twice"),
    **{name: HONOURED[name] for name in ("max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty",
                                         "frequency_penalty", "stream", "stream_options", "logit_bias")},
    "logprobs": (0, lambda sent, r: sent["return_log_probs"] is True
                 and r.json()["choices"][0]["logprobs"]["token_logprobs"] == LOGPROBS),
    "n": (3, lambda sent, r: sent["num_return_sequences"] == 3
          and [c["index"] for c in r.json()["choices"]] == [0, 1, 2]),
}
TEXT_REFUSED = {"best_of": 2, "echo": True, "suffix": "end"}


def test_every_field_of_the_openai_completions_request_is_classified():
    tables = (TEXT_HONOURED, NO_OPS, TEXT_REFUSED)
    assert all(sum(name in t for t in tables) == 1 for name in TEXT_FIELDS), \
        sorted(n for n in TEXT_FIELDS if sum(n in t for t in tables) != 1)


@pytest.mark.parametrize("name", sorted(TEXT_FIELDS))
def test_each_completions_field_is_honoured_or_refused_by_name(api, name):
    _check_field(_text, api, name, TEXT_HONOURED, TEXT_REFUSED)


def test_completions_send_the_prompt_as_it_is_and_answer_in_openais_shape(api, tiny_checkpoint):
    from triton_vlm.tokenizer import load_tokenizer

    response, sent = _text(api, prompt=["<|im_start|>raw"], logprobs=0, top_k=2)
    assert sent["text_input"] == b"<|im_start|>raw" and sent["max_tokens"] == 9 and sent["top_k"] == 2
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    tokenizer = load_tokenizer(tiny_checkpoint)
    tokens = [tokenizer.decode([i], skip_special_tokens=False) for i in (11, 12, 13)]
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("Hello", "length")
    assert choice["logprobs"] == {"tokens": tokens, "token_logprobs": LOGPROBS,
                                  "top_logprobs": [{t: p} for t, p in zip(tokens, LOGPROBS)],
                                  "text_offset": [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]}
    events = _events(_text(api, stream=True, logprobs=0)[0])
    assert all(e["object"] == "text_completion" for e in events)
    assert "".join(c["text"] for e in events for c in e["choices"]) == "Hello"
    assert [o for e in events for c in e["choices"] if c["logprobs"] for o in c["logprobs"]["text_offset"]] \
        == choice["logprobs"]["text_offset"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    _expect_refused(_text(api, prompt=["a", "b"])[0], "prompt")
    alternatives = {tokenizer.decode([20 + j], skip_special_tokens=False): -0.25 * (j + 1) for j in range(2)}
    top = _text(api, logprobs=2)[0].json()["choices"][0]["logprobs"]["top_logprobs"]
    assert top == [{**alternatives, t: p} for t, p in zip(tokens, LOGPROBS)]  # the chosen token too (vLLM's)
    _expect_refused(_text(api, logprobs=21)[0], "logprobs")
    assert _text(api, best_of=1, echo=False)[0].status_code == 200


# ---- constrained decoding: the mapping, not yet wired ---------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, guide, accepts, refuses", [
    ({"response_format": {"type": "json_object"}}, Guide("response_format", "json", None), '{"x": [1]}', "x"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
     Guide("response_format", "json_schema", json.dumps(SCHEMA)), '{"a": 1}', '{"b": 1}'),
    ({"guided_json": SCHEMA}, Guide("guided_json", "json_schema", json.dumps(SCHEMA)), '{"a": 2}', '{"a": "x"}'),
    ({"guided_json": json.dumps(SCHEMA)}, Guide("guided_json", "json_schema", json.dumps(SCHEMA)), '{"a": 3}', "[]"),
    ({"guided_regex": "[0-9]+"}, Guide("guided_regex", "regex", "[0-9]+"), "123", "12a"),
    ({"guided_choice": ["yes", 'say "no"\n']}, Guide("guided_choice", "ebnf_grammar",
                                                      'root ::= "yes" | "say \\"no\\"\\n"'), 'say "no"\n', "maybe"),
    ({"guided_grammar": 'root ::= "a" "b"*', "response_format": {"type": "text"}},
     Guide("guided_grammar", "ebnf_grammar", 'root ::= "a" "b"*'), "abb", "ba"),
])
def test_guided_decoding_maps_to_the_ensembles_two_inputs(fields, guide, accepts, refuses):
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    assert guided_decoding(fields) == guide

    grammar = {"json": lambda g: xgrammar.Grammar.builtin_json_grammar(),
               "json_schema": xgrammar.Grammar.from_json_schema, "regex": xgrammar.Grammar.from_regex,
               "ebnf_grammar": xgrammar.Grammar.from_ebnf}[guide.guide_type](guide.guide)
    assert _is_grammar_accept_string(grammar, accepts) and not _is_grammar_accept_string(grammar, refuses)


@pytest.mark.parametrize("fields, param, message", [
    ({}, None, None), ({"response_format": {"type": "text"}, "guided_json": None}, None, None),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one constraint per request"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one constraint per request"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format", "is required"),
    ({"response_format": {"type": "yaml"}}, "response_format", "not one of"),
    ({"guided_json": "{not json"}, "guided_json", "not a JSON schema"),
    ({"guided_json": 3}, "guided_json", "must be a JSON schema"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
])
def test_guided_decoding_refuses_by_field(fields, param, message):
    if param is None:
        assert guided_decoding(fields) is None
        return
    with pytest.raises(InvalidRequestField, match=message) as raised:
        guided_decoding(fields)
    assert raised.value.param == param



@pytest.mark.parametrize("bias", [{"x": 1}, {"999999": 1}, {"3": 101}])
def test_a_logit_bias_off_the_vocabulary_or_range_is_refused(api, bias):
    _expect_refused(_chat(api, logit_bias=bias)[0], "logit_bias")


@pytest.mark.parametrize("extra, param", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": "x"}}}],
          tool_choice="required"), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"required": [["a"]]}}}],
          tool_choice="required"), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": f"f{i}", "parameters": {"description": "x" * 4000}}}
                 for i in range(80)]), "tools"),  # past max_guide_chars
    (dict(logit_bias={"\u00b2": 1}), "logit_bias"),  # a digit, not an ASCII one
])
def test_malformed_tools_and_bias_keys_are_400s_naming_the_field(api, extra, param):
    _expect_refused(_chat(api, **extra)[0], param)


def test_an_assistant_tool_call_that_is_not_an_object_is_a_400(api):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": "x"}]}]
    response = api.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert response.status_code == 400 and "tool_calls[0].function: must be an object" in response.text
