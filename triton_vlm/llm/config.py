"""`DecoderConfig`: a checkpoint's decoder as the llm computes it, read from its own files (every size,
token id, eos id, rope theta, `mrope_section` and `partial_rotary_factor`) as transformers reads them
(`triton_vlm.llm.text_config`), and the layer layout (attention or linear attention, dense or
mixture-of-experts MLP) of each layer."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from triton_vlm.contract.tensors import embedding_width
from triton_vlm.families import DEFAULT_FAMILY, detect_family
from triton_vlm.llm.layers.linear_attention import LinearAttentionConfig
from triton_vlm.llm.layers.moe import MoeConfig
from triton_vlm.llm.text_config import (LongRope, Rope, Scaling, TextRules, context_limit, layer_type_ropes, layer_types,
                                        text_section, tied)
from triton_vlm.tokenizer import load_tokenizer


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _token_ids(root: Path, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of `tokens` in the checkpoint's tokenizer (`triton_vlm.tokenizer`)."""
    if not tokens:
        return ()
    tokenizer = load_tokenizer(root)
    ids = {t: tokenizer.token_to_id(t) for t in tokens}
    if missing := [t for t, i in ids.items() if i is None]:
        raise ValueError(f"{root}: the tokenizer has no token {missing}")
    return tuple(ids[t] for t in tokens)


def _eos_ids(root: Path, config: dict) -> list[int]:
    """The eos ids `generate` stops on: generation_config.json's where the file exists (transformers
    then reads none from config.json), else config.json's, else its text config's."""
    path = root / "generation_config.json"
    if path.is_file():
        return _ids(json.loads(path.read_text(encoding="utf-8")).get("eos_token_id"))
    return _ids(config.get("eos_token_id")) or _ids((config.get("text_config") or {}).get("eos_token_id"))


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the first `rotary_dim` dims of each head rotate (`partial_rotary_factor`)
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    max_position_embeddings: int  # the positions a sequence may take (`text_config.context_limit`)
    tie_word_embeddings: bool
    placeholder_token_ids: tuple[int, ...]  # prompt tokens replaced by image/video embedding rows
    eos_token_ids: tuple[int, ...]
    family: str = DEFAULT_FAMILY  # the serving family (`triton_vlm.families`), which names the `DecoderSpec`
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" or "linear_attention"
    linear_attention: LinearAttentionConfig | None = None  # set when some layer is linear attention
    mrope_interleaved: bool = False  # the decoder's layout (`TextRules`); config.json's key is never read
    moe: MoeConfig | None = None  # set for mixture-of-experts decoders (config `n_routed_experts`)
    text_model_type: str = ""  # `text_config.model_type`: picks the decoder where a family has several
    longrope: LongRope | None = None  # `rope_type` "longrope": its frequency factors and cos/sin scale
    scaling: Scaling = Scaling()  # embedding, residual and logit multipliers (MiniCPM's)
    deepstack_maps: int = 0  # DeepStack feature maps each vision row carries (`DecoderSpec.deepstack_indexes`)
    # "sliding_attention" layers (`layer_types`) see the keys less than `sliding_window` positions back
    # (Gemma 3's); their rotary has its own theta, and full layers' positions are divided by
    # `rope_linear_factor` (linear scaling).
    sliding_window: int | None = None
    sliding_rope_theta: float | None = None
    rope_linear_factor: float = 1.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # In prefill the tokens of one media run (a run of placeholders) attend to each other both ways
    # (`DecoderSpec.bidirectional_media`).
    bidirectional_media: bool = False

    @property
    def embedding_width(self) -> int:
        """The width of a vision row (`embeddings`): the input embedding, then each DeepStack map
        (`triton_vlm.contract.tensors.embedding_width`)."""
        return embedding_width(self.hidden_size, self.deepstack_maps)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

    @property
    def kv_windows(self) -> tuple[int | None, ...]:
        """Per attention layer (the K/V cache's layer index): its sliding window, None for full attention."""
        return tuple(self.sliding_window if self.layer_types[i] == "sliding_attention" else None for i in self.kv_layers)

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: whether its MLP is the mixture of experts (`MoeConfig.sparse`; none in a
        dense model)."""
        return tuple(self.moe is not None and self.moe.sparse(i) for i in range(self.num_layers))

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that attend over K/V (the pool holds K/V for these only)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in ("full_attention", "sliding_attention"))

    @property
    def recurrent(self) -> bool:
        """Some layer carries a per-sequence recurrent state: a cached K/V prefix alone cannot resume
        a sequence, so prefix caching is off."""
        return len(self.kv_layers) < self.num_layers

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token over the attention layers, in the KV pool's dtype (the model's)."""
        return 2 * len(self.kv_layers) * self.num_kv_heads * self.head_dim * dtype.itemsize

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> "DecoderConfig":
        """Every field as the decoder's transformers text config class reads it (`TextRules`: its
        defaults where config.json leaves a key out, older spellings, keys it ignores)."""
        root = Path(checkpoint_dir)
        cfg = json.loads((root / "config.json").read_text(encoding="utf-8"))
        family = detect_family(root)
        text_model_type = str((cfg.get("text_config") or {}).get("model_type", ""))
        spec = family.decoder_spec(text_model_type)
        rules: TextRules = spec.text
        text = text_section(cfg, rules)

        rope = Rope.read(text, rules)
        sliding_theta, linear_factor = None, 1.0
        if rules.local_rope_theta is not None:  # one rotary per layer type (no M-RoPE)
            ropes = layer_type_ropes(text, rules)
            for kind, params in ropes.items():
                if params.get("rope_type", "default") not in ("default", "linear"):
                    raise NotImplementedError(f"rope_parameters.{kind}.rope_type {params['rope_type']!r} is not "
                                              "supported (default, linear)")
            full = ropes["full_attention"]
            linear_factor = float(full["factor"]) if full.get("rope_type") == "linear" else 1.0
            sliding_theta = float(ropes["sliding_attention"]["rope_theta"])
            rope = Rope("default", float(full["rope_theta"]), 1.0, ())
        if rope.rope_type not in ("default", "longrope") or (rope.rope_type == "longrope" and spec.mrope):
            raise NotImplementedError(f"rope_type {rope.rope_type!r} is not supported (only default M-RoPE, "
                                      "and LongRoPE of 1-D positions)")
        if text.get("use_sliding_window") and not rules.sdpa_sliding_window:
            raise NotImplementedError("sliding-window attention is not supported")
        if refused := [key for key in spec.refused_flags if text.get(key)]:
            raise NotImplementedError(f"{family.name}: text_config {', '.join(refused)} is not supported")
        act = text.get(rules.activation_key, spec.activation)
        if act != spec.activation:
            raise NotImplementedError(f"hidden_act {act!r} is not supported")

        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        head_dim = int((rules.head_dim_key and text.get("head_dim")) or hidden // heads)
        rotary_dim = int(head_dim * rope.rotary_factor)
        longrope = LongRope.read(text, rope.scaling, rotary_dim) if rope.rope_type == "longrope" else None
        positions = context_limit(text, rules)
        if longrope is not None and longrope.short_factor != longrope.long_factor:
            # The long factors would turn the keys of a sequence's later steps only: positions end
            # before they apply.
            positions = min(positions, longrope.original_max_position_embeddings)
        section = rope.mrope_section if spec.mrope else (rotary_dim // 2,)  # 1-D RoPE: the first position row
        # Frequencies in runs split exactly by the section (transformers' `split`); interleaved, the
        # section only bounds the height and width frequencies, so any section fits.
        if not rules.mrope_interleaved and sum(section) * 2 != rotary_dim:
            raise ValueError(f"mrope_section {list(section)} does not cover the {rotary_dim} rotary dims of each head")

        eos = _eos_ids(root, cfg) + list(_token_ids(root, spec.eos_tokens))
        placeholders = (tuple(int(cfg[k]) for k in spec.placeholder_keys if cfg.get(k) is not None)
                        + _token_ids(root, spec.placeholder_tokens))
        num_layers = int(text["num_hidden_layers"])
        # without use_sliding_window (refused above) transformers' "sliding_attention" layers attend fully,
        # but in decoders whose sliding layers always slide (`TextRules.sliding_layers`)
        types = tuple("full_attention" if t == "sliding_attention" and not rules.sliding_layers else t
                      for t in layer_types(text, rules, num_layers))
        unknown = set(types) - {"full_attention", "linear_attention", "sliding_attention"}
        if len(types) != num_layers or unknown:
            raise ValueError(f"config.json: layer_types {list(types)} for {num_layers} layers")
        linear = None
        if "linear_attention" in types:
            if spec.linear_layer is None:
                raise NotImplementedError(f"{family.name}: no linear-attention layer registered")
            linear = LinearAttentionConfig(
                num_k_heads=int(text["linear_num_key_heads"]), num_v_heads=int(text["linear_num_value_heads"]),
                k_head_dim=int(text["linear_key_head_dim"]), v_head_dim=int(text["linear_value_head_dim"]),
                conv_kernel=int(text["linear_conv_kernel_dim"]))
        deepstack = 0
        if spec.deepstack_indexes is not None:
            vision = cfg.get("vision_config") or {}
            deepstack = len(vision.get("deepstack_visual_indexes", spec.deepstack_indexes) or ())
        moe = MoeConfig.from_text_config(text)
        if moe is not None and spec.moe_layer is None:
            raise NotImplementedError(f"{family.name}: no mixture-of-experts layer registered")
        if moe is not None and linear is not None and spec.moe_linear_layer is None:
            raise NotImplementedError(f"{family.name}: no mixture-of-experts linear-attention layer registered")
        return cls(
            vocab_size=int(text["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]), num_layers=num_layers,
            num_heads=heads, num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=head_dim, rotary_dim=rotary_dim, rms_norm_eps=float(text["rms_norm_eps"]),
            rope_theta=rope.theta, mrope_section=tuple(section),
            max_position_embeddings=positions,
            tie_word_embeddings=tied(cfg, text, rules), placeholder_token_ids=placeholders,
            eos_token_ids=tuple(dict.fromkeys(eos)), family=family.name, layer_types=types, linear_attention=linear,
            mrope_interleaved=rules.mrope_interleaved, moe=moe, text_model_type=text_model_type, longrope=longrope,
            scaling=Scaling.read(text, rules), deepstack_maps=deepstack,
            sliding_window=int(text["sliding_window"]) if "sliding_attention" in types else None,
            sliding_rope_theta=sliding_theta, rope_linear_factor=linear_factor,
            attention_scale=(float(text[rules.attention_scale_key]) ** -0.5 if rules.attention_scale_key else None),
            bidirectional_media=spec.bidirectional_media,
        )
