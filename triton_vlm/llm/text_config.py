"""A checkpoint's text config as transformers reads it.

Published `config.json`s differ from what our demo writer writes: keys left out (transformers' config
class fills in its own defaults), older spellings (`rope_scaling` for `rope_parameters`, `rope_theta`
and `partial_rotary_factor` beside it, a config's text fields at its top level), keys
transformers ignores. `TextRules` says, per decoder (`DecoderSpec.text`), what its transformers text
config class defaults and what its text model reads; `text_section` and `Rope.read` apply them.
"""
from __future__ import annotations

import math
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
    # Whether the model reads `head_dim` (else hidden_size // num_attention_heads: transformers
    # 4.40's Qwen2) and `rope_scaling` / `rope_parameters` (4.40's Qwen2 reads neither: plain RoPE
    # of `rope_theta`).
    head_dim_key: bool = True
    rope_scaling: bool = True
    # Under SDPA the causal mask hides keys more than `sliding_window` positions back whatever
    # `use_sliding_window` says (transformers 4.40's Qwen2): `use_sliding_window` is not read, and the
    # context ends where the window would start to hide a key (`context_limit`).
    sdpa_sliding_window: bool = False
    # MiniCPM's scalings (`Scaling`): its config's `scale_emb`, `scale_depth` and `dim_model_base`.
    mup_scaling: bool = False
    # Gemma 3's: `sliding_attention` layers hide keys `sliding_window` or more positions back (others'
    # attend fully without `use_sliding_window`); where `layer_types` is left out, every n-th layer
    # is full attention and the others sliding (`sliding_window_pattern`, this default; 0: none).
    sliding_layers: bool = False
    sliding_window_pattern: int = 0
    # A rotary per layer type (`rope_parameters` {"full_attention": ..., "sliding_attention": ...}),
    # this the sliding layers' default theta (`rope_local_base_freq`); None: one rotary.
    local_rope_theta: float | None = None
    # The config key of the MLP's activation, and of the attention's scale (its -1/2 power; None:
    # head_dim's); token embeddings scaled by sqrt(hidden_size) (Gemma's).
    activation_key: str = "hidden_act"
    attention_scale_key: str | None = None
    sqrt_hidden_embedding: bool = False


@dataclass(frozen=True)
class Scaling:
    """Multipliers a decoder applies beside the plain pre-norm stack (none: all 1). MiniCPM's
    (`TextRules.mup_scaling`): input token embeddings times `scale_emb` (vision rows are not
    scaled), each residual branch times `scale_depth / sqrt(num_hidden_layers)`, the final hidden
    state divided by `hidden_size / dim_model_base` before the head."""
    embedding: float = 1.0
    residual: float = 1.0
    logits_divisor: float = 1.0
    # The embedding multiplier rounded to the model's dtype first (Gemma's `embed_scale.to(dtype)`).
    embedding_in_dtype: bool = False

    @classmethod
    def read(cls, text: dict[str, Any], rules: TextRules) -> "Scaling":
        if rules.sqrt_hidden_embedding:
            return cls(embedding=math.sqrt(int(text["hidden_size"])), embedding_in_dtype=True)
        if not rules.mup_scaling:
            return cls()
        return cls(embedding=float(text["scale_emb"]),
                   residual=float(text["scale_depth"]) / math.sqrt(int(text["num_hidden_layers"])),
                   logits_divisor=int(text["hidden_size"]) / float(text["dim_model_base"]))


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
    pattern = int(text.get("sliding_window_pattern") or rules.sliding_window_pattern) if rules.sliding_layers else 0
    if pattern:
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))
    interval = int(text.get("full_attention_interval") or rules.full_attention_interval)
    return tuple("linear_attention" if interval and (i + 1) % interval else "full_attention" for i in range(num_layers))


def context_limit(text: dict[str, Any], rules: TextRules) -> int:
    """The positions a sequence may take: `max_position_embeddings`, and where the SDPA mask
    applies `sliding_window` (`TextRules.sdpa_sliding_window`), no more than the window lets every
    key be seen (a query at position q sees keys from q - sliding_window on)."""
    limit = int(text["max_position_embeddings"])
    if rules.sdpa_sliding_window and text.get("sliding_window") is not None:
        limit = min(limit, int(text["sliding_window"]) + 1)
    return limit


@dataclass(frozen=True)
class LongRope:
    """LongRoPE (`rope_type` "longrope"), as transformers 4.51 computes it
    (`_compute_longrope_parameters`, `dynamic_rope_update`): each frequency divided by its
    `short_factor` entry, by its `long_factor` one once a forward's positions pass
    `original_max_position_embeddings` (the config's top-level key, else `max_position_embeddings`;
    the `rope_scaling` dict's is not read); cos and sin scaled by `attention_factor` (the dict's, else
    1 for a `factor` up to 1, else sqrt(1 + ln(factor) / ln(original))), `factor` being
    max_position_embeddings / original where the top-level key exists, else the dict's."""
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    attention_factor: float
    original_max_position_embeddings: int

    @classmethod
    def read(cls, text: dict[str, Any], rope: dict[str, Any], rotary_dim: int) -> "LongRope":
        short, long = (tuple(float(f) for f in rope[key]) for key in ("short_factor", "long_factor"))
        if len(short) != rotary_dim // 2 or len(long) != rotary_dim // 2:
            raise ValueError(f"rope_scaling: short_factor and long_factor need {rotary_dim // 2} entries "
                             f"(half the rotary dims), got {len(short)} and {len(long)}")
        factor = rope.get("factor")
        if text.get("original_max_position_embeddings") is not None:
            original = int(text["original_max_position_embeddings"])
            factor = int(text["max_position_embeddings"]) / original
        else:
            original = int(text["max_position_embeddings"])
        attention = rope.get("attention_factor")
        if attention is None and factor is None:
            raise ValueError("rope_scaling: longrope takes a factor or an attention_factor")
        if attention is None:
            attention = 1.0 if float(factor) <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return cls(short, long, float(attention), original)


@dataclass(frozen=True)
class Rope:
    """The decoder's rotary as the text model computes it."""
    rope_type: str
    theta: float
    rotary_factor: float
    mrope_section: tuple[int, ...]
    # The `rope_scaling` dict, where the model reads one (LongRoPE's factors).
    scaling: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, text: dict[str, Any], rules: TextRules) -> "Rope":
        """transformers takes `rope_scaling` over `rope_parameters` (each an older and a newer
        spelling of one dict), then `rope_theta` and `partial_rotary_factor` from the dict, else
        beside it, else the class's defaults; the older type "mrope" is "default".
        `mrope_interleaved` is not read: the layout is the model's (`TextRules.mrope_interleaved`)."""
        rope = dict(text.get("rope_scaling") or text.get("rope_parameters") or {}) if rules.rope_scaling else {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        factor = 1.0 if rules.partial_rotary_factor is None else float(
            rope.get("partial_rotary_factor", text.get("partial_rotary_factor", rules.partial_rotary_factor)))
        return cls(rope_type="default" if rope_type == "mrope" else str(rope_type),
                   theta=float(rope.get("rope_theta", text.get("rope_theta", rules.rope_theta))),
                   rotary_factor=factor,
                   mrope_section=tuple(int(s) for s in rope.get("mrope_section") or rules.mrope_section),
                   scaling=rope)


def layer_type_ropes(text: dict[str, Any], rules: TextRules) -> dict[str, dict[str, Any]]:
    """Each layer type's rotary parameters where the model has one per type (`rules.local_rope_theta`),
    as Gemma 3's config class completes them: `rope_parameters[type]`, the older `rope_scaling` over
    the full layers', `rope_theta` and `rope_local_base_freq` beside them, else the class's thetas."""
    params = dict(text.get("rope_parameters") or {})
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    full.update(text.get("rope_scaling") or {})
    full.setdefault("rope_theta", text.get("rope_theta", rules.rope_theta))
    sliding = dict(params.get("sliding_attention") or {"rope_type": "default"})
    sliding.setdefault("rope_theta", text.get("rope_local_base_freq", rules.local_rope_theta))
    return {"full_attention": full, "sliding_attention": sliding}
