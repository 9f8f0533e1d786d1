"""A checkpoint's text config as transformers reads it.

Published `config.json`s differ from what our demo writer writes: keys left out (transformers' config
class fills in its own defaults), older spellings (`rope_scaling` for `rope_parameters`, `rope_theta`
and `partial_rotary_factor` beside it, a config's text fields at its top level), keys
transformers ignores. `TextRules` says, per decoder (`DecoderSpec.text`), what its transformers text
config class defaults and what its text model reads; `text_section` and `Rope.read` apply them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TextRules:
    """What one transformers text config class (and the text model that reads it) does with keys
    a `config.json` leaves out or spells otherwise."""
    # The class's defaults of the keys the decoder reads (sizes included: some published
    # `text_config`s hold little more than a `model_type`); `num_key_value_heads` and `head_dim`
    # left out or None are `num_attention_heads` and `hidden_size // num_attention_heads`.
    defaults: dict[str, Any] = field(default_factory=dict)
    rope_theta: float = 10000.0                   # the class's `default_theta`
    # Where `layer_types` is left out: every n-th layer is full attention, the others linear
    # (Qwen3.5's `full_attention_interval`, default 4); 0: every layer is full attention.
    full_attention_interval: int = 0
    # The rotary's share of each head where the config gives no `partial_rotary_factor`; None: the
    # model rotates the whole head and never reads the key (Qwen2, Llama).
    partial_rotary_factor: float | None = 1.0
    # The rotary embedding's `mrope_section` where `rope_parameters` has none (empty: 1-D RoPE).
    mrope_section: tuple[int, ...] = ()
    # The model's M-RoPE layout: interleaved (t, h, w, t, ...: Qwen3.5's `recomposition_frequencies`)
    # or in runs. transformers fixes it per model and never reads a config's `mrope_interleaved`.
    mrope_interleaved: bool = False
    # The model config class's `tie_word_embeddings` default (lm_head is the embedding), and the
    # `model_type`s whose class takes a true `text_config.tie_word_embeddings` over a false top level.
    tie_word_embeddings: bool = False
    tie_from_text: tuple[str, ...] = ()
    # Without a `text_config`, the text fields are the config's top level (older hub configs,
    # remote-code configs); otherwise the class takes its text config's defaults.
    flat: bool = False


def class_defaults(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int | None,
                   max_positions: int, eps: float, **more) -> dict:
    """A text config class's defaults (`TextRules.defaults`)."""
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                rms_norm_eps=eps, **more)


def text_section(config: dict[str, Any], rules: TextRules) -> dict[str, Any]:
    """The text config as its class holds it: `text_config` (or, `rules.flat` and no `text_config`,
    the top level) over the class's defaults. transformers ignores top-level text fields beside a
    `text_config`."""
    if config.get("text_config") is not None or not rules.flat:
        section = dict(config.get("text_config") or {})
    else:
        section = {k: v for k, v in config.items() if k != "vision_config"}
    return {**rules.defaults, **section}


def tied(config: dict[str, Any], text: dict[str, Any], rules: TextRules) -> bool:
    """`tie_word_embeddings` as the model config class decides it (the top level's; the text
    config's only where the class forwards it, and in a flat config the two are one)."""
    tie = bool(config.get("tie_word_embeddings", rules.tie_word_embeddings))
    return tie or (config.get("model_type") in rules.tie_from_text and bool(text.get("tie_word_embeddings")))


def layer_types(text: dict[str, Any], rules: TextRules, num_layers: int) -> tuple[str, ...]:
    """Each layer's type: the config's `layer_types`, else the class's pattern."""
    if text.get("layer_types"):
        return tuple(text["layer_types"])
    interval = int(text.get("full_attention_interval") or rules.full_attention_interval)
    return tuple("linear_attention" if interval and (i + 1) % interval else "full_attention" for i in range(num_layers))


@dataclass(frozen=True)
class Rope:
    """The decoder's rotary as the text model computes it."""
    rope_type: str
    theta: float
    rotary_factor: float
    mrope_section: tuple[int, ...]

    @classmethod
    def read(cls, text: dict[str, Any], rules: TextRules) -> "Rope":
        """transformers takes `rope_scaling` over `rope_parameters` (each an older and a newer
        spelling of one dict), then `rope_theta` and `partial_rotary_factor` from the dict, else
        beside it, else the class's defaults; the older type "mrope" is "default".
        `mrope_interleaved` is not read: the layout is the model's (`TextRules.mrope_interleaved`)."""
        rope = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        factor = 1.0 if rules.partial_rotary_factor is None else float(
            rope.get("partial_rotary_factor", text.get("partial_rotary_factor", rules.partial_rotary_factor)))
        return cls(rope_type="default" if rope_type == "mrope" else str(rope_type),
                   theta=float(rope.get("rope_theta", text.get("rope_theta", rules.rope_theta))),
                   rotary_factor=factor,
                   mrope_section=tuple(int(s) for s in rope.get("mrope_section") or rules.mrope_section))
