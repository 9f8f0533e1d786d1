"""Tool calls in a model's answer, as the chat template of its family writes them, parsed back into
OpenAI's `tool_calls` (what vLLM's tool parsers do).

Formats (`Prompt.tool_call_format` names one):
- "hermes" (Qwen2.5, Qwen3 and the models on them: vLLM's `hermes` parser): each call
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- "glm45" (GLM-4.5 and on: vLLM's `glm45` parser): each call `<tool_call>NAME\\n<arg_key>K</arg_key>\\n
  <arg_value>V</arg_value>...</tool_call>`, a value JSON where it parses, else the string.

The text before the first call is the message's content. `ToolCallStream` splits streamed text the
same way: content is passed on as it comes, except what may begin a call, and the calls are
parsed once the answer ends. An answer whose calls do not parse is content, as vLLM returns it.

A request's `tool_choice` (`tool_choice`): "auto" (the model may call), "none" (the answer is not
parsed), "required" or a named function: then the answer is one call, forced by constrained
decoding (`forced_call_grammar`: an EBNF grammar for the ensemble's `guided_decoding_guide` of a
call in the family's format, its arguments from the function's `parameters` schema).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    import xgrammar

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


class ToolCallError(ValueError):
    """The answer holds a call its format cannot read (the model wrote it wrong)."""


def _hermes(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        raise ToolCallError(f"a tool call is not JSON: {error}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError("a tool call has no name")
    arguments = call.get("arguments", call.get("parameters", {}))
    return ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm45(body: str) -> ToolCall:
    name, _, rest = body.strip().partition("\n")
    if not name.strip() or "<" in name:
        raise ToolCallError("a tool call has no name")
    arguments = {}
    for key, value in _GLM_ARGUMENT.findall(rest):
        try:
            arguments[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            arguments[key.strip()] = value
    return ToolCall(name.strip(), json.dumps(arguments, ensure_ascii=False))


FORMATS: dict[str, Callable[[str], ToolCall]] = {"hermes": _hermes, "glm45": _glm45}


def parse_tool_calls(text: str, tool_format: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of an answer: the text before the first `<tool_call>`, and each call. A call
    left open at the end (the answer cut short) is refused as a `ToolCallError`."""
    parse = FORMATS[tool_format]
    first = text.find(START)
    if first < 0:
        return text, []
    calls, at = [], first
    while at >= 0:
        end = text.find(END, at)
        if end < 0:
            raise ToolCallError("a tool call is not closed (the answer ended inside it)")
        calls.append(parse(text[at + len(START):end].strip()))
        at = text.find(START, end)
    return text[:first], calls


class ToolCallStream:
    """Streamed text split into content and calls: `feed` returns the content that can go out now
    (all of it, but a tail that may be the start of `<tool_call>`); `finish` the content held back
    and the calls."""

    def __init__(self, tool_format: str):
        self.format = tool_format
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        self.text += delta
        first = self.text.find(START, self.sent)  # (what was sent holds no call's start)
        if first >= 0:
            end = first
        else:  # hold back a tail that could still become `<tool_call>`
            end = len(self.text)
            for n in range(min(len(START) - 1, len(self.text)), 0, -1):
                if START.startswith(self.text[-n:]):
                    end = len(self.text) - n
                    break
        out, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = parse_tool_calls(self.text, self.format)
        rest, self.sent = content[self.sent:], len(content)
        return rest, calls


def tool_names(tools: Sequence[Any]) -> list[str]:
    """The function names of OpenAI's `tools` (`{"type": "function", "function": {"name", ...}}`),
    or ValueError naming what is wrong."""
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}]: must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             f"...}}}}, got {tool!r}")
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema (an object)")
        if not isinstance(parameters.get("properties", {}), dict) \
                or not all(isinstance(p, dict) for p in parameters.get("properties", {}).values()):
            raise ValueError(f"tools[{i}].function.parameters.properties: must map names to JSON schemas")
        required = parameters.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"tools[{i}].function.parameters.required: must be a list of names")
        names.append(function["name"])
    return names


def tool_choice(choice: Any, tools: Sequence[Any]) -> str:
    """A request's `tool_choice` as "none", "auto", "required" or the function name it forces
    (default: "auto" with tools, "none" without), or ValueError naming what is wrong."""
    names = tool_names(tools)
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise ValueError(f"names no function of tools ({', '.join(names) or 'none given'}): {choice!r}")
        return name
    if choice not in ("none", "auto", "required"):
        raise ValueError(f"must be none, auto, required or a function, got {choice!r}")
    if choice != "none" and not names:
        raise ValueError(f"{choice} needs tools")
    return choice


def _literal(text: str) -> "xgrammar.Grammar":
    import xgrammar

    return xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _hermes_call(function: dict) -> "xgrammar.Grammar":
    """`<tool_call>\n` + a JSON object of the function's name and arguments (its `parameters`
    schema) + `\n</tool_call>`."""
    import xgrammar

    schema = {"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
              "properties": {"name": {"const": function["name"]},
                             "arguments": function.get("parameters") or {"type": "object"}}}
    return xgrammar.Grammar.concat(_literal(START + "\n"),
                                   xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
                                   _literal("\n" + END))


def _glm45_value(schema: dict) -> "xgrammar.Grammar":
    """An `<arg_value>` as GLM-4.5's template writes it: a string as it is (here without `<`, so it
    cannot run into the closing tag; an enum's strings as listed), anything else as JSON."""
    import xgrammar

    if schema.get("type") == "string" or (schema.get("enum") and all(isinstance(v, str) for v in schema["enum"])):
        if schema.get("enum"):
            return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(v) for v in schema["enum"]))
        return xgrammar.Grammar.from_ebnf("root ::= [^<]*")
    return xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def _glm45_call(function: dict) -> "xgrammar.Grammar":
    """`<tool_call>NAME\n`, each required argument of its `parameters` schema in their order as
    `<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n`, `</tool_call>` (the optional ones left out)."""
    import xgrammar

    parameters = function.get("parameters") or {}
    properties = parameters.get("properties") or {}
    parts = [_literal(f"{START}{function['name']}\n")]
    for key in parameters.get("required") or []:
        parts += [_literal(f"<arg_key>{key}</arg_key>\n<arg_value>"), _glm45_value(properties.get(key) or {}),
                  _literal("</arg_value>\n")]
    return xgrammar.Grammar.concat(*parts, _literal(END))


_CALL_GRAMMARS = {"hermes": _hermes_call, "glm45": _glm45_call}


def forced_call_grammar(tools: Sequence[Any], forced: str, tool_format: str) -> str:
    """The EBNF grammar of one call, in `tool_format`, to the `forced` function (or, "required",
    to any of `tools`), with the arguments its `parameters` schema requires."""
    import xgrammar

    calls = [_CALL_GRAMMARS[tool_format](t["function"]) for t in tools
             if forced == "required" or t["function"]["name"] == forced]
    return str(calls[0] if len(calls) == 1 else xgrammar.Grammar.union(*calls))
