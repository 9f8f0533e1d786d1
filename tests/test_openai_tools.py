"""Tool calling through `triton-vlm openai` with the official `openai` client, against the session's
real tritonserver: the server's checkpoint copy carries a chat template that renders tools (Qwen2.5's
hermes format, reduced), the tools and the tool messages go through it, and the answer's
`<tool_call>` JSON comes back as `tool_calls`. With random weights a call is only made when it is
forced (`tool_choice` required or named: constrained decoding writes it), so those are checked to
the argument; "auto" is checked to parse the answer as the ensemble gave it."""
from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from triton_vlm.clients.chat import render_chat
from triton_vlm.clients.client import generate_payload, http_generate
from triton_vlm.clients.tool_calls import parse_tool_calls
from triton_vlm.families import FAMILIES

MODEL = "tiny-qwen-tools"
# Qwen2.5's chat template's tool parts (its system block, an assistant's calls, a tool's answer),
# with the demo's media parts.
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You are a helpful assistant.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}
{%- if part.type == "image" %}<|vision_start|><|image_pad|><|vision_end|>{% elif part.type == "text" %}{{ part.text }}
{%- endif %}{% endfor %}{% endif %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "required": ["city", "days"],
                                                           "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                                                          "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["utc", "cet"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The served checkpoint's files, with a chat template that renders tools."""
    out = tmp_path_factory.mktemp("tools") / "checkpoint"
    shutil.copytree(tiny_checkpoint, out)
    (out / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def api(server, tools_checkpoint, tmp_path_factory):
    from tests.servers import openai_api

    with openai_api(server.grpc_url, tools_checkpoint, tmp_path_factory.mktemp("openai") / "openai.log", MODEL) as api:
        yield api


def _arguments(call, tool: dict) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_forced_call_comes_back_as_tool_calls_streamed_and_not(api, choice):
    answer = api.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME] if choice == "required"
                                         else [WEATHER], tool_choice=choice, max_tokens=80, temperature=0)
    (result,) = answer.choices
    assert result.finish_reason == "tool_calls" and not result.message.content
    (call,) = result.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    arguments = _arguments(call, tool)
    assert call.type == "function" and call.id.startswith("call_")
    chunks = list(api.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME] if choice == "required"
                                              else [WEATHER], tool_choice=choice, max_tokens=80, temperature=0,
                                              stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    (streamed,) = [t for d in deltas for t in d.tool_calls or []]
    assert (streamed.function.name, json.loads(streamed.function.arguments)) == (call.function.name, arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and not "".join(d.content or "" for d in deltas)


def test_auto_parses_the_ensembles_answer(api, server, tools_checkpoint):
    """"auto": the tools rendered by the template, the answer the ensemble's own for that prompt,
    its calls (if the random model writes any that parse) as `tool_calls`, the rest the content."""
    family = FAMILIES["qwen2_5_vl"]
    prompt = render_chat(TOOLS_TEMPLATE, family, ASK, [WEATHER])
    assert "<tools>" in prompt and '"get_weather"' in prompt
    (direct,) = http_generate(server.http_url, generate_payload(prompt, max_tokens=24))
    answer = api.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=24, temperature=0)
    content, calls = parse_tool_calls(direct["text_output"], "hermes")
    assert answer.choices[0].message.content == content and len(answer.choices[0].message.tool_calls or []) == len(calls)


def test_a_conversation_with_calls_and_tool_answers_renders_and_continues(api):
    """An assistant's earlier call (its arguments JSON text) and the tool's answer go through the
    template; the next call is forced again."""
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
        {"role": "user", "content": "And tomorrow?"}]
    answer = api.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=80,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    _arguments(answer.choices[0].message.tool_calls[0], WEATHER)


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {}}]), "tools"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
])
def test_bad_tool_requests_are_refused_naming_the_field(api, kwargs, param):
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kwargs)
    assert refused.value.body["param"] == param, refused.value.body
