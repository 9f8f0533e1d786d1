"""Constrained decoding asked of the OpenAI-compatible server, as the ensemble's inputs.

OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's extensions `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar` map to tensorrtllm_backend's two inputs:
`guided_decoding_guide_type` (json | json_schema | regex | ebnf_grammar) and
`guided_decoding_guide` (the schema, pattern or grammar; none for json). A choice is a grammar of
its strings as literals (`root ::= "a" | "b"`, as vLLM's xgrammar backend writes it). At most one
guide per request; a malformed one is refused with `InvalidRequestField` naming its field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class InvalidRequestField(ValueError):
    """A request field's value cannot be served; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class Guide:
    """One request's constraint: the field it came from, its type and its text (None for json)."""
    param: str
    guide_type: str
    guide: str | None


def _schema_text(param: str, schema: Any) -> str:
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError as error:
            raise InvalidRequestField(param, f"not a JSON schema ({error})") from None
        return schema
    if not isinstance(schema, dict):
        raise InvalidRequestField(param, f"must be a JSON schema (an object), got {type(schema).__name__}")
    return json.dumps(schema)


def _text(param: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestField(param, f"must be a non-empty string, got {value!r}")
    return value


def _response_format_guide(response_format: Any) -> Guide | None:
    if not isinstance(response_format, dict):
        raise InvalidRequestField("response_format", f"must be an object with a type, got {response_format!r}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("response_format", "json", None)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise InvalidRequestField("response_format", "json_schema.schema: a JSON schema is required")
        return Guide("response_format", "json_schema", _schema_text("response_format", spec["schema"]))
    raise InvalidRequestField("response_format", f"type {kind!r} is not one of text, json_object, json_schema")


def _choice_grammar(choices: Any) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestField("guided_choice", f"must be a non-empty list of non-empty strings, got {choices!r}")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def guided_decoding(fields: Mapping[str, Any]) -> Guide | None:
    """The constraint a request's `response_format` and `guided_*` fields ask for (None: none)."""
    guides = []
    if fields.get("response_format") is not None:
        guide = _response_format_guide(fields["response_format"])
        if guide is not None:
            guides.append(guide)
    for param in GUIDED_FIELDS:
        value = fields.get(param)
        if value is None:
            continue
        if param == "guided_json":
            guides.append(Guide(param, "json_schema", _schema_text(param, value)))
        elif param == "guided_regex":
            guides.append(Guide(param, "regex", _text(param, value)))
        elif param == "guided_choice":
            guides.append(Guide(param, "ebnf_grammar", _choice_grammar(value)))
        else:
            guides.append(Guide(param, "ebnf_grammar", _text(param, value)))
    if len(guides) > 1:
        raise InvalidRequestField(guides[1].param, f"one constraint per request, and {guides[0].param} sets one")
    return guides[0] if guides else None
