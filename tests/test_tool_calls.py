"""`triton_vlm.clients.tool_calls`: the calls of an answer in the hermes and GLM-4.5 formats, whole
and streamed in pieces of every size (the streamed content and calls equal the whole answer's)."""
from __future__ import annotations

import json

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
