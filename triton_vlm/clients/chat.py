"""The checkpoint's chat template, applied as transformers' processors apply it.

One function renders every chat prompt the project sends (`triton-vlm infer`, the OpenAI server,
the demo): messages whose content is a string or parts `{"type": "text", "text": ...}`,
`{"type": "image"}`, `{"type": "video"}` go through the template with the generation prompt, in
transformers' own Jinja environment (`render_jinja_template`, what `apply_chat_template(tokenize=
False)` calls). The template writes each media part's placeholder; the result is checked to hold
the family's placeholders exactly once per media part, in order, since `preprocess` expands them
in that order (and a text part that spells a placeholder would otherwise take a media item's place).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from triton_vlm.errors import InvalidInput
from triton_vlm.families.base import Family

MEDIA_TYPES = ("image", "video")


SPECIAL_TOKEN_VARIABLES = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_chat_template(checkpoint: str | Path) -> str | None:
    """The template a transformers processor of this checkpoint applies, or None: its
    `chat_template.jinja`, else `chat_template.json`, else the tokenizer config's (`default` where
    it names several), else its family's chat format (`Prompt.chat_template`). transformers renders
    it with the tokenizer's special tokens as variables (a template may write `bos_token`): those
    the checkpoint names are set first in the template, so that it renders alike wherever it
    travels (the `ensemble` config, clients)."""
    checkpoint = Path(checkpoint)
    template = None
    if (checkpoint / "chat_template.jinja").is_file():
        template = (checkpoint / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        if template is None and (checkpoint / name).is_file():
            template = json.loads((checkpoint / name).read_text(encoding="utf-8")).get("chat_template")
            if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
                template = {t["name"]: t["template"] for t in template}.get("default")
            template = template or None
    if template is None and (checkpoint / "config.json").is_file():
        from triton_vlm.families import detect_family

        template = detect_family(checkpoint).prompt.chat_template
    if template is None:
        return None
    tokens = _special_tokens(checkpoint)
    return "".join(f"{{% set {name} = {json.dumps(tokens[name])} %}}" for name in SPECIAL_TOKEN_VARIABLES
                   if name in tokens) + template


def _special_tokens(checkpoint: Path) -> dict[str, str]:
    """The tokenizer's named special tokens (`special_tokens_map.json` under `tokenizer_config.json`),
    each a string or an added token's `content`."""
    tokens: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (checkpoint / name).is_file():
            config = json.loads((checkpoint / name).read_text(encoding="utf-8"))
            for key in SPECIAL_TOKEN_VARIABLES:
                value = config.get(key)
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    tokens[key] = value
    return tokens


def check_tools(template: str, family: Family) -> None:
    """InvalidInput naming `tools` unless the template renders tools and the family has a format to
    read the answer's calls in (`Prompt.tool_call_format`)."""
    if family.prompt.tool_call_format is None or "tools" not in template:
        raise InvalidInput(f"tools: the served checkpoint ({family.name}) has no tool calling: its chat template "
                           "does not render tools, or its family has no tool call format")


def render_chat(template: str, family: Family, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt of `messages` (content a string or text / image / video parts) with the
    generation prompt, and OpenAI's `tools` where given (the template must render them, and the
    family must have a format to read its calls back in: else InvalidInput naming `tools`);
    InvalidInput unless it holds one placeholder per media part, in order."""
    from transformers.utils.chat_template_utils import render_jinja_template

    if tools:
        check_tools(template, family)
    conversation = [_as_text(m, family) for m in messages] if family.prompt.chat_content_as_text else messages
    prompts, _ = render_jinja_template(conversations=[conversation], tools=tools or None, chat_template=template,
                                       add_generation_prompt=True, **family.prompt.chat_template_kwargs)
    prompt = prompts[0]
    asked = [part["type"] for m in messages if isinstance(m.get("content"), list)
             for part in m["content"] if part["type"] in MEDIA_TYPES]
    placeholders = {family.image_placeholder: "image", family.video_placeholder: "video"}
    found = [placeholders[p] for p in re.findall("|".join(map(re.escape, placeholders)), prompt)]
    if found != asked:
        raise InvalidInput(f"messages: the chat-templated prompt holds placeholders for [{', '.join(found)}] where "
                           f"the messages have media [{', '.join(asked)}] (a text part must not hold "
                           f"{family.image_placeholder!r} or {family.video_placeholder!r})")
    return prompt


def _as_text(message: dict, family: Family) -> dict:
    """A message with its parts joined into one string (`Family.chat_content_as_text`)."""
    if not isinstance(message.get("content"), list):
        return message
    placeholders = {"image": family.image_placeholder, "video": family.video_placeholder}
    parts = [placeholders[part["type"]] if part["type"] in MEDIA_TYPES else part["text"] for part in message["content"]]
    return {**message, "content": "\n".join(parts)}


def user_prompt(template: str, family: Family, text: str, images: int = 0, videos: int = 0) -> str:
    """One user turn: the images, then the videos, then the text."""
    content = [{"type": "image"}] * images + [{"type": "video"}] * videos + [{"type": "text", "text": text}]
    return render_chat(template, family, [{"role": "user", "content": content}])
