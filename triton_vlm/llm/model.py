"""The Qwen2 decoder of Qwen2.5-VL with M-RoPE, float32 on CPU, read from a Hugging Face checkpoint.

Follows `transformers.models.qwen2_5_vl.modeling_qwen2_5_vl` (text model) closely enough that greedy
tokens equal Hugging Face's: RMSNorm, GQA attention with q/k/v biases, SwiGLU MLP, M-RoPE whose
rotary frequencies are split by `mrope_section` over the temporal / height / width position axes.

Every size, token id, eos id, rope theta and `mrope_section` comes from the checkpoint's files.
The KV cache sits behind `KVCache` (`append`, `length`, `free`) so that a paged cache can replace
the contiguous one later without touching the model or the engine.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from triton_vlm.errors import InvalidInput
from triton_vlm.weights import read_safetensors

# Where the language model's weights live, newest layout first (v5 writes either).
_DECODER_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "language_model.")
_LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    image_token_id: int | None
    video_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> "DecoderConfig":
        root = Path(checkpoint_dir)
        cfg = json.loads((root / "config.json").read_text())
        # Older Qwen2.5-VL configs hold the text fields at top level; v5 nests them in text_config.
        text = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
        text.update(cfg.get("text_config") or {})

        rope = dict(text.get("rope_parameters") or {})
        legacy = text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
        if rope_type not in ("default", "mrope"):
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported (only default M-RoPE)")
        theta = rope.get("rope_theta", text.get("rope_theta"))
        section = rope.get("mrope_section", legacy.get("mrope_section"))
        if theta is None or section is None:
            raise ValueError("config.json: rope_theta and mrope_section are required")
        if text.get("use_sliding_window"):
            raise NotImplementedError("sliding-window attention is not supported")
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act {act!r} is not supported")

        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or hidden // heads)
        if sum(section) * 2 != head_dim:
            raise ValueError(f"mrope_section {section} does not cover head_dim {head_dim}")

        eos = _ids(cfg.get("eos_token_id")) + _ids((cfg.get("text_config") or {}).get("eos_token_id"))
        gen_path = root / "generation_config.json"
        if gen_path.exists():
            eos = _ids(json.loads(gen_path.read_text()).get("eos_token_id")) + eos
        tie = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        return cls(
            vocab_size=int(text["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]), num_layers=int(text["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(text.get("num_key_value_heads") or heads), head_dim=head_dim,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            mrope_section=tuple(int(s) for s in section),
            max_position_embeddings=int(text["max_position_embeddings"]), tie_word_embeddings=tie,
            image_token_id=cfg.get("image_token_id"), video_token_id=cfg.get("video_token_id"),
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )


class KVCache:
    """Per-sequence contiguous KV cache: one [kv_heads, capacity, head_dim] pair per layer.

    The interface (`append`, `length`, `nbytes`, `free`) is what a paged cache will provide too.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32):
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.keys: torch.Tensor | None = torch.empty(shape, dtype=dtype)
        self.values: torch.Tensor | None = torch.empty(shape, dtype=dtype)
        self.capacity = capacity
        self.length = 0  # tokens stored in every layer once a forward pass is complete
        self.nbytes = 2 * self.keys.numel() * self.keys.element_size()

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([kv_heads, n, head_dim]) after `length`; return all keys and values so far."""
        if self.keys is None:
            raise RuntimeError("KV cache used after free()")
        end = self.length + k.shape[1]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} > {self.capacity}")
        self.keys[layer, :, self.length:end] = k
        self.values[layer, :, self.length:end] = v
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def free(self) -> None:
        self.keys = self.values = None
        self.nbytes = 0

    @property
    def freed(self) -> bool:
        return self.keys is None


class _Layer:
    __slots__ = ("ln1", "ln2", "wq", "bq", "wk", "bk", "wv", "bv", "wo", "w_gate", "w_up", "w_down")


class DecoderModel:
    """The language model of a Qwen2.5-VL checkpoint. Not thread-safe: one caller at a time."""

    def __init__(self, config: DecoderConfig, weights: dict[str, torch.Tensor]):
        self.config = c = config
        prefix = next((p for p in _DECODER_PREFIXES if p + "embed_tokens.weight" in weights), None)
        if prefix is None:
            raise ValueError("checkpoint has no embed_tokens.weight for the language model")

        def w(name: str) -> torch.Tensor:
            return weights[prefix + name].contiguous()

        self.embed_tokens = w("embed_tokens.weight")
        self.norm = w("norm.weight")
        head = next((weights[k] for k in _LM_HEAD_KEYS if k in weights), None)
        self.lm_head = self.embed_tokens if (c.tie_word_embeddings or head is None) else head.contiguous()
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"layers.{i}."
            L = _Layer()
            L.ln1, L.ln2 = w(p + "input_layernorm.weight"), w(p + "post_attention_layernorm.weight")
            L.wq, L.bq = w(p + "self_attn.q_proj.weight"), w(p + "self_attn.q_proj.bias")
            L.wk, L.bk = w(p + "self_attn.k_proj.weight"), w(p + "self_attn.k_proj.bias")
            L.wv, L.bv = w(p + "self_attn.v_proj.weight"), w(p + "self_attn.v_proj.bias")
            L.wo = w(p + "self_attn.o_proj.weight")
            L.w_gate, L.w_up = w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")
            L.w_down = w(p + "mlp.down_proj.weight")
            self.layers.append(L)
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim))
        self.mm_token_ids = [t for t in (c.image_token_id, c.video_token_id) if t is not None]

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> "DecoderModel":
        root = Path(checkpoint_dir)
        config = DecoderConfig.from_checkpoint(root)
        weights = read_safetensors(root, lambda k: None if ("visual" in k or "vision" in k or k.startswith("mlp1")) else k)
        return cls(config, weights)

    # ---- cache ---------------------------------------------------------------------------------
    def new_cache(self, capacity: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity)

    # ---- pieces --------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + self.config.rms_norm_eps))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, head_dim] from 3-D positions [3, n], frequencies split by mrope_section."""
        freqs = positions[..., None].float() * self.inv_freq  # [3, n, head_dim/2]
        cos, sin = freqs.cos(), freqs.sin()

        def recompose(f: torch.Tensor) -> torch.Tensor:
            parts = f.split(list(self.config.mrope_section), dim=-1)
            f = torch.cat([m[i % 3] for i, m in enumerate(parts)], dim=-1)
            return torch.cat((f, f), dim=-1)

        return recompose(cos), recompose(sin)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _forward(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """h [n, hidden] for positions [3, n] after the cache's contents; returns final-normed hidden."""
        c = self.config
        n = h.shape[0]
        cos, sin = self.rope(positions)
        causal = cache.length == 0 and n > 1
        if cache.length > 0 and n > 1:
            raise NotImplementedError("chunked prefill onto a non-empty cache")
        for i, L in enumerate(self.layers):
            x = self._rms(h, L.ln1)
            q = F.linear(x, L.wq, L.bq).view(n, c.num_heads, c.head_dim).transpose(0, 1)
            k = F.linear(x, L.wk, L.bk).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
            v = F.linear(x, L.wv, L.bv).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
            q = q * cos + self._rotate_half(q) * sin
            k = k * cos + self._rotate_half(k) * sin
            keys, values = cache.append(i, k, v)
            attn = F.scaled_dot_product_attention(
                q[None], keys[None], values[None], is_causal=causal, scale=c.head_dim ** -0.5,
                enable_gqa=c.num_kv_heads != c.num_heads)
            attn = attn[0].transpose(0, 1).reshape(n, c.num_heads * c.head_dim)
            h = h + F.linear(attn, L.wo)
            x = self._rms(h, L.ln2)
            h = h + F.linear(F.silu(F.linear(x, L.w_gate)) * F.linear(x, L.w_up), L.w_down)
        cache.advance(n)
        return self._rms(h, self.norm)

    # ---- public --------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, embeddings: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings with the image/video placeholder rows replaced by `embeddings` in order."""
        ids = input_ids.reshape(-1).long()
        h = F.embedding(ids, self.embed_tokens)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for t in self.mm_token_ids:
            mask |= ids == t
        n_placeholders = int(mask.sum())
        n_rows = 0 if embeddings is None else int(embeddings.shape[0])
        if n_rows != n_placeholders:
            raise InvalidInput(f"embeddings: {n_rows} rows given, prompt has {n_placeholders} "
                               f"image/video placeholder tokens")
        if n_rows:
            if embeddings.ndim != 2 or embeddings.shape[1] != self.config.hidden_size:
                raise InvalidInput(f"embeddings: shape {list(embeddings.shape)}, expected "
                                   f"[{n_placeholders}, {self.config.hidden_size}]")
            h[mask] = embeddings.to(h.dtype)
        return h

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, embeddings: torch.Tensor | None, positions: torch.Tensor,
                cache: KVCache | None = None, capacity: int | None = None) -> tuple[torch.Tensor, KVCache]:
        """Run the prompt; return the last position's logits [vocab] and the filled cache."""
        h = self.embed(input_ids, embeddings)
        n = h.shape[0]
        positions = torch.as_tensor(positions).long().reshape(3, -1)
        if positions.shape[1] != n:
            raise InvalidInput(f"mrope_position_ids: shape [3, {positions.shape[1]}], expected [3, {n}]")
        if cache is None:
            cache = self.new_cache(capacity or n)
        try:
            out = self._forward(h, positions, cache)
        except BaseException:
            cache.free()
            raise
        return F.linear(out[-1], self.lm_head), cache

    @torch.inference_mode()
    def decode(self, token_id: int, position: int, cache: KVCache) -> torch.Tensor:
        """One new token at the same position on all three axes; returns its logits [vocab]."""
        h = F.embedding(torch.tensor([int(token_id)]), self.embed_tokens)
        positions = torch.full((3, 1), int(position), dtype=torch.long)
        out = self._forward(h, positions, cache)
        return F.linear(out[-1], self.lm_head)
