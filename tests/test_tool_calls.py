"""`triton_vlm.clients.tool_calls`: the calls of an answer in the hermes and GLM-4.5 formats, whole
and streamed in pieces of every size (the streamed content and calls equal the whole answer's)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from triton_vlm.clients.tool_calls import ToolCallError, ToolCallStream, parse_tool_calls

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
GLM45 = ("Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")


def test_hermes_calls_and_the_content_before_them():
    content, calls = parse_tool_calls(HERMES, "hermes")
    assert content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 2}),
                                                                  ("get_time", {})]
    call = calls[0].as_openai(0)
    assert call["type"] == "function" and call["id"].startswith("call_") and call["index"] == 0


def test_glm45_calls_with_json_values_where_they_parse():
    content, calls = parse_tool_calls(GLM45, "glm45")
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 2})]


def test_an_answer_without_calls_is_all_content():
    assert parse_tool_calls("just text < tool", "hermes") == ("just text < tool", [])


@pytest.mark.parametrize("text, match", [
    ('<tool_call>\n{"name": "f", "arguments": {}}', "not closed"),
    ("<tool_call>\nnot json\n</tool_call>", "not JSON"),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', "no name")])
def test_a_call_the_format_cannot_read_is_an_error(text, match):
    with pytest.raises(ToolCallError, match=match):
        parse_tool_calls(text, "hermes")


@pytest.mark.parametrize("text, tool_format", [(HERMES, "hermes"), (GLM45, "glm45"), ("no calls <tool", "hermes")])
@pytest.mark.parametrize("size", [1, 2, 5, 11, 1000])
def test_streamed_pieces_give_the_whole_answers_content_and_calls(text, tool_format, size):
    stream, sent = ToolCallStream(tool_format), []
    for i in range(0, len(text), size):
        sent.append(stream.feed(text[i:i + size]))
        assert "".join(sent) == text[:len("".join(sent))] and "<tool_c" not in "".join(sent)  # no call's text goes out
    rest, calls = stream.finish()
    content, expected = parse_tool_calls(text, tool_format)
    assert "".join(sent) + rest == content and calls == expected


# ---- forced calls: the grammar of one call in each format ------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string"}}}}}
ZONE = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone", "exact"],
    "properties": {"zone": {"enum": ["utc", "cet"]}, "exact": {"type": "boolean"}}}}}


def _accepts(grammar: str, text: str) -> bool:
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgrammar.Grammar.from_ebnf(grammar), text)


def test_the_glm45_forced_call_is_the_templates_call_with_the_required_arguments():
    from triton_vlm.clients.tool_calls import forced_call_grammar

    weather = forced_call_grammar([WEATHER, ZONE], "get_weather", "glm45")
    call = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris, 16e</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
    assert _accepts(weather, call)
    assert parse_tool_calls(call, "glm45")[1][0].arguments == json.dumps({"city": "Paris, 16e", "days": 2})
    for wrong in (call.replace("get_weather", "get_time"), call.replace("<arg_value>2<", "<arg_value>two<"),
                  call.replace("Paris", "<b>Paris"), call.split("<arg_key>days")[0] + "</tool_call>", "Sure. " + call):
        assert not _accepts(weather, wrong), wrong
    either = forced_call_grammar([WEATHER, ZONE], "required", "glm45")
    time_call = ("<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>cet</arg_value>\n"
                 "<arg_key>exact</arg_key>\n<arg_value>true</arg_value>\n</tool_call>")
    assert _accepts(either, call) and _accepts(either, time_call)
    assert not _accepts(either, time_call.replace("cet", "pst"))


@pytest.mark.parametrize("tool_format", ["hermes", "glm45"])
def test_forced_calls_a_random_model_writes_parse_and_fit_the_schema(tiny_checkpoint, tool_format):
    """The hard case: a random-weight model's answers under the forced grammar, greedy and sampled,
    are one call each, to a function asked for, whose arguments validate against its schema."""
    import jsonschema

    from triton_vlm.clients.tool_calls import forced_call_grammar
    from triton_vlm.llm import Engine, SamplingParams
    from triton_vlm.tokenizer import load_tokenizer

    tools = [ZONE, {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "required": ["n"], "properties": {"n": {"enum": [1, 2, 3]}}}}}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    grammar = forced_call_grammar(tools, "required", tool_format)
    ids = load_tokenizer(tiny_checkpoint).encode("<|im_start|>user\nWhat time is it?<|im_end|>\n<|im_start|>assistant\n",
                                                 add_special_tokens=False).ids
    texts, done = {}, {}
    with Engine(tiny_checkpoint) as engine:
        for seed in (None, 1, 2):
            import threading

            done[seed], texts[seed] = threading.Event(), []

            def emit(out, seed=seed):
                texts[seed].append(out.text)
                if out.finished:
                    done[seed].set()
            params = SamplingParams(max_tokens=250, guide_type="ebnf_grammar", guide=grammar,
                                    temperature=0.0 if seed is None else 1.0, seed=seed)
            engine.submit(f"forced-{seed}", np.array(ids, np.int32), None, None, None, params, emit=emit)
        for seed in texts:
            assert done[seed].wait(120)
    for seed, pieces in texts.items():
        content, (call,) = parse_tool_calls("".join(pieces), tool_format)
        assert content == "" and call.name in schemas, "".join(pieces)
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


@pytest.mark.parametrize("parallel, calls", [(True, 2), (False, 1)])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel, calls):
    from triton_vlm.clients.openai_responses import ToolShape

    whole = ToolShape(None, "hermes", parallel=parallel).choice(HERMES, [], None, "stop")
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather", "get_time"][:calls]
    streamed = ToolShape(None, "hermes", parallel=parallel)
    streamed.delta(HERMES, [1], None, None)
    last = streamed.delta("", [], None, "stop")
    assert len(last["delta"]["tool_calls"]) == calls and last["finish_reason"] == "tool_calls"
