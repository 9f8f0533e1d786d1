"""The decoders of the served VLMs with M-RoPE, read from a Hugging Face checkpoint, in float32,
bfloat16 or float16 on CPU or CUDA.

Follows transformers' text models closely enough that greedy tokens equal Hugging Face's:
- Qwen2 (Qwen2.5-VL, `modeling_qwen2_5_vl`): RMSNorm, GQA attention with q/k/v biases, SwiGLU
  MLP, rotate-half rotary over the whole head;
- GLM-4 (GLM-4.1V, GLM-4.6V, GLMGA: `glm4v_text`, `modeling_glm4v`): the same attention and MLP
  with an RMSNorm after each of them too, rotary over the first `partial_rotary_factor` of each
  head with interleaved pairs (0, 1), (2, 3), ...; GLM-OCR's (`modeling_glm_ocr`) is the same
  without q/k/v biases;
- GLM-4.5V (`glm4v_moe`, `modeling_glm4v_moe`): Qwen2's layer (q/k/v biases, two RMSNorms) with
  GLM's partial rotary in rotate-half pairs; the MLP of every layer from `first_k_dense_replace`
  on is a mixture of experts (`triton_vlm.llm.moe`); the multi-token-prediction layers past
  `num_hidden_layers` are not loaded;
- Qwen3.5 (MiniCPM-V 4.6: `qwen3_5_text`, `modeling_qwen3_5`): a hybrid stack. Full-attention
  layers have q/k RMSNorms, a sigmoid output gate and partial rotate-half rotary; linear-attention
  layers (Gated DeltaNet, `triton_vlm.llm.linear_attention`) keep a per-sequence recurrent state
  (the runner's `StateCache`) instead of K/V. Its RMSNorms scale by `1 + weight`.
- Llama and Qwen2 under LLaVA (`llava`, the decoder picked by `text_config.model_type`): Llama is
  Qwen2's layer without q/k/v biases; both have 1-D RoPE (one section, turned by the first of the
  three position rows, which `preprocess` sends equal).
The others split the rotary frequencies by `mrope_section` over the temporal / height / width axes,
in runs (t.., h.., w..) or interleaved (t, h, w, t, h, w, ...: `mrope_interleaved`).

Every size, token id, eos id, rope theta, `mrope_section` and `partial_rotary_factor` comes from
the checkpoint's files.
In bfloat16 / float16 the numerics are transformers' in that dtype (`from_pretrained(dtype=...)`):
every weight is rounded to the dtype once, at load (but those transformers keeps in float32,
`_FLOAT32_WEIGHTS`); RMSNorms compute in float32 and cast back where transformers' do (`_rms`);
rotary angles, cos and sin are float32, cast to the dtype before they rotate; attention runs through
SDPA in the dtype; the linear-attention layers and the MoE router keep transformers' float32 islands
(`triton_vlm.llm.linear_attention`, `triton_vlm.llm.moe`); logits come out of lm_head in the dtype
and are returned as float32 (as `generate` takes them).
`forward` runs one flat batch of token rows from many sequences (prefill chunks and decode tokens
together, `StepBatch`) through every linear layer at once; attention goes through the backend the
model runner passes (`triton_vlm.llm.attention`: paged K/V, attention per sequence).
What differs per family is data (the `DecoderSpec` its `Family` names: `QWEN2`, `GLM4`, ...): the layer class,
how rotary dims pair up, which token ids are image/video placeholders, the layer class of MoE layers.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from triton_vlm.errors import InvalidInput
from triton_vlm.families import detect_family, get_family
from triton_vlm.llm import cuda_ops
from triton_vlm.llm.device import parse_device, parse_dtype
from triton_vlm.llm.linear_attention import GatedDeltaNet, LinearAttentionConfig, RecurrentRows
from triton_vlm.llm.moe import MoeConfig, SparseMoe, swiglu
from triton_vlm.llm.sharding import Shard
from triton_vlm.llm.tensor_parallel import all_reduce, gather_logits
from triton_vlm.weights import read_safetensors

if TYPE_CHECKING:
    from triton_vlm.llm.attention import AttentionBackend
    from triton_vlm.llm.paged import StateCache

# Where the language model's weights live, newest layout first (v5 writes either).
_DECODER_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "language_model.", "llm.model.")
_LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight", "llm.lm_head.weight")
# A decoder layer's weights: (prefix, layer index).
_LAYER_KEY = re.compile("^(?:" + "|".join(map(re.escape, _DECODER_PREFIXES)) + r")layers\.(\d+)\.")
# Weights transformers keeps in float32 whatever the model's dtype (`_keep_in_fp32_modules_strict`).
_FLOAT32_WEIGHTS = ("e_score_correction_bias",)
# Vision weights whose names say neither "visual" nor "vision" (MiniCPM-V 4.5: `vpm`, `resampler`).
_VISION_PREFIXES = ("mlp1", "model.merger.", "vpm.", "resampler.", "model.multi_modal_projector.",
                    "multi_modal_projector.")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _added_token_ids(root: Path, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of `tokens` among the checkpoint tokenizer's added tokens (tokenizer.json)."""
    if not tokens:
        return ()
    added = {t["content"]: int(t["id"]) for t in json.loads((root / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens", [])}
    if missing := [t for t in tokens if t not in added]:
        raise ValueError(f"tokenizer.json: no added token {missing}")
    return tuple(added[t] for t in tokens)


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
    max_position_embeddings: int
    tie_word_embeddings: bool
    placeholder_token_ids: tuple[int, ...]  # prompt tokens replaced by image/video embedding rows
    eos_token_ids: tuple[int, ...]
    family: str = "qwen2_5_vl"  # the serving family (`triton_vlm.families`), which names the `DecoderSpec`
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" or "linear_attention"
    linear_attention: LinearAttentionConfig | None = None  # set when some layer is linear attention
    mrope_interleaved: bool = False
    moe: MoeConfig | None = None  # set for mixture-of-experts decoders (config `n_routed_experts`)
    text_model_type: str = ""  # `text_config.model_type`: picks the decoder where a family has several

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: whether its MLP is the mixture of experts (layers from the MoE config's
        `first_k_dense_replace` on; none in a dense model)."""
        first = self.num_layers if self.moe is None else self.moe.first_k_dense_replace
        return tuple(i >= first for i in range(self.num_layers))

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that attend over K/V (the pool holds K/V for these only)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

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
        root = Path(checkpoint_dir)
        cfg = json.loads((root / "config.json").read_text(encoding="utf-8"))
        family = detect_family(root)
        text_model_type = str((cfg.get("text_config") or {}).get("model_type", ""))
        spec = family.decoder_spec(text_model_type)
        # Older Qwen2.5-VL configs hold the text fields at top level; v5 (and GLM) nest them in text_config.
        text = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
        text.update(cfg.get("text_config") or {})

        rope = dict(text.get("rope_parameters") or {})
        legacy = text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
        if rope_type not in ("default", "mrope"):
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported (only default M-RoPE)")
        theta = rope.get("rope_theta", text.get("rope_theta"))
        section = rope.get("mrope_section", legacy.get("mrope_section"))
        if theta is None or (section is None and spec.mrope):
            raise ValueError("config.json: rope_theta and mrope_section are required")
        if text.get("use_sliding_window"):
            raise NotImplementedError("sliding-window attention is not supported")
        if refused := [key for key in spec.refused_flags if text.get(key)]:
            raise NotImplementedError(f"{family.name}: text_config {', '.join(refused)} is not supported")
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act {act!r} is not supported")

        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or hidden // heads)
        factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
        rotary_dim = int(head_dim * float(factor))
        if not spec.mrope:  # 1-D RoPE: one section, turned by the first position row
            section = (rotary_dim // 2,)
        if sum(section) * 2 != rotary_dim:
            raise ValueError(f"mrope_section {section} does not cover the {rotary_dim} rotary dims of each head")

        eos = _ids(cfg.get("eos_token_id")) + _ids((cfg.get("text_config") or {}).get("eos_token_id"))
        gen_path = root / "generation_config.json"
        if gen_path.exists():
            eos = _ids(json.loads(gen_path.read_text(encoding="utf-8")).get("eos_token_id")) + eos
        eos += _added_token_ids(root, spec.eos_tokens)
        tie = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        placeholders = (tuple(int(cfg[k]) for k in spec.placeholder_keys if cfg.get(k) is not None)
                        + _added_token_ids(root, spec.placeholder_tokens))
        num_layers = int(text["num_hidden_layers"])
        # without use_sliding_window (refused above) transformers' "sliding_attention" layers attend fully
        layer_types = tuple("full_attention" if t == "sliding_attention" else t
                            for t in text.get("layer_types") or ("full_attention",) * num_layers)
        unknown = set(layer_types) - {"full_attention", "linear_attention"}
        if len(layer_types) != num_layers or unknown:
            raise ValueError(f"config.json: layer_types {list(layer_types)} for {num_layers} layers")
        linear = None
        if "linear_attention" in layer_types:
            if spec.linear_layer is None:
                raise NotImplementedError(f"{family.name}: no linear-attention layer registered")
            linear = LinearAttentionConfig(
                num_k_heads=int(text["linear_num_key_heads"]), num_v_heads=int(text["linear_num_value_heads"]),
                k_head_dim=int(text["linear_key_head_dim"]), v_head_dim=int(text["linear_value_head_dim"]),
                conv_kernel=int(text["linear_conv_kernel_dim"]))
        moe = MoeConfig.from_text_config(text)
        if moe is not None and spec.moe_layer is None:
            raise NotImplementedError(f"{family.name}: no mixture-of-experts layer registered")
        return cls(
            vocab_size=int(text["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]), num_layers=num_layers,
            num_heads=heads, num_kv_heads=int(text.get("num_key_value_heads") or heads), head_dim=head_dim,
            rotary_dim=rotary_dim, rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            mrope_section=tuple(int(s) for s in section),
            max_position_embeddings=int(text["max_position_embeddings"]), tie_word_embeddings=tie,
            placeholder_token_ids=placeholders, eos_token_ids=tuple(dict.fromkeys(eos)), family=family.name,
            layer_types=layer_types, linear_attention=linear,
            mrope_interleaved=bool(rope.get("mrope_interleaved", legacy.get("mrope_interleaved", False))),
            moe=moe, text_model_type=text_model_type,
        )


@dataclass
class StepBatch:
    """One forward pass's inputs, built once per step by the model runner: the input embeddings of
    every row (prefill chunks and decode tokens of many sequences, one flat batch), their 3-D
    positions, the attention metadata, where each sequence's linear-attention rows and state slot
    are (hybrid decoders), and the rows whose logits are wanted."""
    h: torch.Tensor                    # [T, hidden]
    positions: torch.Tensor            # [3, T]
    attn: Any                          # the attention backend's metadata
    recurrent: RecurrentRows | None
    logits_rows: torch.Tensor          # [R] long



def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it in any dtype: the variance and the normalization in
    float32. A weight in x's dtype scales after the cast back (Qwen2RMSNorm, Glm4vRMSNorm: `weight *
    x.to(dtype)`); a float32 weight before it (Qwen3_5RMSNorm: `(x * (1 + weight.float())).to(dtype)`,
    see `SwiGLULayer.norm_weight`). In float32 both are the same. On CUDA, one kernel (`cuda_ops`)."""
    if x.is_cuda:
        return cuda_ops.rms_norm(x, weight, eps)
    return rms_torch(x, weight, eps)


def rms_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`_rms` in torch ops (the CPU path, and the reference of the CUDA kernel)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (normed * weight).to(x.dtype)
    return weight * normed.to(x.dtype)


# ---- rotary -------------------------------------------------------------------------------------
class HalfPairs:
    """rotate_half (Qwen2): rotary dim i pairs with dim i +- r/2; both turn by frequency i mod r/2."""
    interleaved = False

    @staticmethod
    def partners(x: torch.Tensor) -> torch.Tensor:
        return x.roll(x.shape[-1] // 2, -1)

    @staticmethod
    def tables(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.arange(r)
        return torch.where(i < r // 2, -1.0, 1.0), i % (r // 2)


class InterleavedPairs:
    """rotate_half_llm (GLM-4): rotary dims (0, 1), (2, 3), ... pair up; pair j turns by frequency j."""
    interleaved = True

    @staticmethod
    def partners(x: torch.Tensor) -> torch.Tensor:
        return torch.stack((x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    @staticmethod
    def tables(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.arange(r)
        return torch.where(i % 2 == 0, -1.0, 1.0), i // 2


class Rotary:
    """M-RoPE over the first `rotary_dim` dims of each head (the rest pass through). A pairing
    (`HalfPairs`, `InterleavedPairs`) gives each rotary dim its partner's value (`partners`), the
    sign of the partner's term and the frequency that turns the pair (`tables`); `mrope_section`
    assigns the frequencies to the temporal / height / width position axes in turn. Dim i turns by
    `positions[axis[i]] * inv_freq[i]`, and `x * cos + partners(x) * sin` (sign folded into `sin`)
    is exactly transformers' `x * cos + rotate_half(x) * sin`. Interleaved M-RoPE (Qwen3.5's
    `recomposition_frequencies`): frequency j turns by the height axis if j % 3 == 1 and
    j < 3 * section[1], by the width axis if j % 3 == 2 and j < 3 * section[2], else by time.
    As in transformers, angles, cos and sin are float32 whatever the model's dtype; cos and sin are
    cast to `dtype` before they rotate q and k (in `dtype`)."""

    def __init__(self, config: DecoderConfig, pairing: type, device: torch.device = torch.device("cpu"),
                 dtype: torch.dtype = torch.float32):
        r = self.rotary_dim = config.rotary_dim
        sign, freq = pairing.tables(r)
        section = config.mrope_section
        if config.mrope_interleaved:
            j = torch.arange(r // 2)
            axis_of_freq = torch.where((j % 3 == 1) & (j < 3 * section[1]), 1,
                                       torch.where((j % 3 == 2) & (j < 3 * section[2]), 2, 0))
        else:
            axis_of_freq = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))
        self.axis, self.inv_freq, self.sign = (t.to(device) for t in (axis_of_freq[freq], inv_freq[freq], sign))
        self.dtype = dtype
        self.partners, self.interleaved = pairing.partners, pairing.interleaved
        self.partial = r < config.head_dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, rotary_dim] in the model's dtype for 3-D positions [3, n] (on any device)."""
        angles = positions.to(self.axis.device)[self.axis].t().float() * self.inv_freq
        return angles.cos().to(self.dtype), (angles.sin() * self.sign).to(self.dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated; cos, sin [T, 1, rotary_dim]. On CUDA, one kernel (`cuda_ops`)."""
        if x.is_cuda:
            return cuda_ops.rotary(x, cos, sin, self.interleaved)
        return self.apply_torch(x, cos, sin)

    def apply_torch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply` in torch ops (the CPU path, and the reference of the CUDA kernel)."""
        if not self.partial:
            return x * cos + self.partners(x) * sin
        rot = x[..., :self.rotary_dim]
        return torch.cat([rot * cos + self.partners(rot) * sin, x[..., self.rotary_dim:]], dim=-1)


# ---- layers -------------------------------------------------------------------------------------
def _whole(x: torch.Tensor) -> torch.Tensor:
    return x


class SwiGLULayer:
    """What every decoder layer here shares: the input and post-attention RMSNorms (scaling by
    `norm_offset + weight`) and the SwiGLU MLP. Attention layers add `qkv` and `finish` (the model
    applies the rotary and attends between them); recurrent layers (`recurrent = True`) add
    `forward` over their per-sequence states instead."""
    norm_offset = 0.0
    recurrent = False

    def __init__(self, w: Callable[[str], torch.Tensor], config: DecoderConfig, shard: Shard = Shard()):
        """`config`: this rank's (`Shard.config`); `w` gives this rank's part of each weight."""
        self.c, self.shard = config, shard
        # a row-parallel output (o_proj, down, the experts) summed over the ranks; unsplit, itself
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _whole if shard.world == 1 else all_reduce
        self.ln1 = self.norm_weight(w("input_layernorm.weight"))
        self.ln2 = self.norm_weight(w("post_attention_layernorm.weight"))
        self.init_mlp(w)

    def init_mlp(self, w: Callable[[str], torch.Tensor]) -> None:
        # gate/up run as one matmul (weights concatenated once, at load)
        self.w_gate_up = self.gate_up_weight(w)
        self.w_down = w("mlp.down_proj.weight")

    @classmethod
    def norm_weight(cls, weight: torch.Tensor) -> torch.Tensor:
        """An RMSNorm's weight as `_rms` takes it. Offset norms (Qwen3.5's `1 + weight`) keep it in
        float32, as transformers adds the offset to the upcast weight and scales before casting
        back; plain ones keep it in the model's dtype, scaling after the cast."""
        return weight.float() + cls.norm_offset if cls.norm_offset else weight

    @staticmethod
    def gate_up_weight(w: Callable[[str], torch.Tensor]) -> torch.Tensor:
        return torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")])

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(swiglu(x, self.w_gate_up, self.w_down))

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        """The layer's second half: post-attention RMSNorm, MLP, residual add."""
        return h + self.mlp(_rms(h, self.ln2, self.c.rms_norm_eps))


class Qwen2Layer(SwiGLULayer):
    """One Qwen2 decoder layer: RMSNorm, GQA attention with q/k/v biases, SwiGLU MLP. Subclasses
    turn the biases off (`qkv_bias`) or have q_proj yield each head's output gate after its query
    (`q_gate`)."""
    qkv_bias = True
    q_gate = False

    def __init__(self, w: Callable[[str], torch.Tensor], config: DecoderConfig, shard: Shard = Shard()):
        super().__init__(w, config, shard)
        c = config
        # q/k/v run as one matmul
        self.w_qkv = torch.cat([w(f"self_attn.{p}_proj.weight") for p in "qkv"])
        self.b_qkv = torch.cat([w(f"self_attn.{p}_proj.bias") for p in "qkv"]) if self.qkv_bias else None
        self.wo = w("self_attn.o_proj.weight")
        kv = c.num_kv_heads * c.head_dim
        self._split = ((1 + self.q_gate) * c.num_heads * c.head_dim, kv, kv)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """h [T, hidden] -> q [T, heads, d] (with `q_gate`: [T, heads, 2d]), k, v [T, kv_heads, d]
        before the rotary, and the output gate `finish` takes (None: no gate)."""
        c, n = self.c, h.shape[0]
        x = _rms(h, self.ln1, c.rms_norm_eps)
        q, k, v = F.linear(x, self.w_qkv, self.b_qkv).split(self._split, dim=-1)
        return (q.view(n, c.num_heads, -1), k.view(n, c.num_kv_heads, c.head_dim),
                v.view(n, c.num_kv_heads, c.head_dim), None)

    def finish(self, h: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Residual of the attention output [T, heads * d], then the MLP block."""
        return self.mlp_block(h + self.reduce(F.linear(attn, self.wo)))


class Glm4Layer(Qwen2Layer):
    """One GLM-4 decoder layer (`Glm4vTextDecoderLayer`): Qwen2's attention and SwiGLU MLP (gate
    and up stored fused), each output RMS-normed again (`post_self_attn_layernorm`,
    `post_mlp_layernorm`) before its residual add."""

    def __init__(self, w: Callable[[str], torch.Tensor], config: DecoderConfig, shard: Shard = Shard()):
        super().__init__(w, config, shard)
        self.ln_post_attn = w("post_self_attn_layernorm.weight")
        self.ln_post_mlp = w("post_mlp_layernorm.weight")

    @staticmethod
    def gate_up_weight(w: Callable[[str], torch.Tensor]) -> torch.Tensor:
        return w("mlp.gate_up_proj.weight")

    def finish(self, h: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        eps = self.c.rms_norm_eps
        h = h + _rms(self.reduce(F.linear(attn, self.wo)), self.ln_post_attn, eps)
        return h + _rms(self.mlp(_rms(h, self.ln2, eps)), self.ln_post_mlp, eps)


class GlmOcrLayer(Glm4Layer):
    """A GLM-OCR decoder layer (`GlmOcrTextDecoderLayer`): GLM-4's, without q/k/v biases."""
    qkv_bias = False


class Glm4MoeLayer(Qwen2Layer):
    """A GLM-4.5V mixture-of-experts layer (`Glm4vMoeTextDecoderLayer` from `first_k_dense_replace`
    on): Qwen2's attention and norms; the MLP is `Glm4vMoeTextMoE` (`triton_vlm.llm.moe.SparseMoe`).
    GLM-4.5V's dense layers are `Qwen2Layer`s."""

    def init_mlp(self, w: Callable[[str], torch.Tensor]) -> None:
        self.moe = SparseMoe(w, self.c.moe, self.shard.experts(self.c.moe.num_experts))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.moe(x))


class LlamaLayer(Qwen2Layer):
    """A Llama decoder layer (`LlamaDecoderLayer` with `attention_bias` and `mlp_bias` false, their
    defaults, as LLaVA's checkpoints have them; others are refused): Qwen2's without q/k/v biases."""
    qkv_bias = False


class Qwen3Layer(Qwen2Layer):
    """A Qwen3 decoder layer (`Qwen3DecoderLayer`): Qwen2's without q/k/v biases; q and k are
    RMS-normed per head before the rotary (`q_norm`, `k_norm`)."""
    qkv_bias = False

    def __init__(self, w: Callable[[str], torch.Tensor], config: DecoderConfig, shard: Shard = Shard()):
        super().__init__(w, config, shard)
        self.q_norm = self.norm_weight(w("self_attn.q_norm.weight"))
        self.k_norm = self.norm_weight(w("self_attn.k_norm.weight"))

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        d, eps = self.c.head_dim, self.c.rms_norm_eps
        q, k, v, _ = super().qkv(h)
        gate = q[..., d:].reshape(h.shape[0], -1) if self.q_gate else None
        return _rms(q[..., :d], self.q_norm, eps), _rms(k, self.k_norm, eps), v, gate


class Qwen35AttentionLayer(Qwen3Layer):
    """A Qwen3.5 full-attention layer (`Qwen3_5Attention`): Qwen3's, with q_proj yielding each
    head's query and its output gate side by side; the attention output is multiplied by
    sigmoid(gate) before o_proj. Norms scale by 1 + weight."""
    norm_offset = 1.0
    q_gate = True

    def finish(self, h: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return super().finish(h, attn * torch.sigmoid(gate), None)


class Qwen35LinearLayer(SwiGLULayer):
    """A Qwen3.5 linear-attention layer: the Gated DeltaNet token mixer over each sequence's
    recurrent state, then the MLP; norms scale by 1 + weight."""
    norm_offset = 1.0
    recurrent = True

    def __init__(self, w: Callable[[str], torch.Tensor], config: DecoderConfig, shard: Shard = Shard()):
        super().__init__(w, config, shard)
        self.mixer = GatedDeltaNet(w, config.linear_attention, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, rows: RecurrentRows, conv_state: torch.Tensor,
                recurrent_state: torch.Tensor) -> torch.Tensor:
        h = h + self.reduce(self.mixer(_rms(h, self.ln1, self.c.rms_norm_eps), rows, conv_state, recurrent_state))
        return self.mlp_block(h)


# ---- the families' decoders ---------------------------------------------------------------------
@dataclass(frozen=True)
class DecoderSpec:
    """What one family's decoder is made of: its (attention) layer class, how its rotary dims pair
    up, the config keys of the token ids its prompts hold image/video placeholders under, the
    layer class of its `linear_attention` layers (hybrid stacks; config `layer_types`) and of its
    mixture-of-experts layers (`DecoderConfig.moe_layers`)."""
    layer: type
    rotary_pairing: type  # HalfPairs or InterleavedPairs
    placeholder_keys: tuple[str, ...]
    linear_layer: type | None = None
    moe_layer: type | None = None
    # Placeholder tokens by their text, for checkpoints whose config names none (MiniCPM-V 4.5:
    # `<unk>`), looked up in the tokenizer's added tokens.
    placeholder_tokens: tuple[str, ...] = ()
    # Stop tokens by their text, beside the config's eos ids (MiniCPM-V 4.5's chat passes
    # `<|im_end|>` and `<|endoftext|>` as terminators; its config names the first only).
    eos_tokens: tuple[str, ...] = ()
    # False: 1-D RoPE (the config has no mrope_section); the first position row turns every dim.
    mrope: bool = True
    # Text config flags this decoder does not implement: a checkpoint that sets one is refused.
    refused_flags: tuple[str, ...] = ()

    def layer_class(self, layer_type: str, moe: bool) -> type:
        """The class of a layer of `layer_type` (config `layer_types`) whose MLP is (`moe`) or is
        not a mixture of experts."""
        if layer_type == "linear_attention":
            return self.linear_layer
        return self.moe_layer if moe else self.layer


# The families' decoders; each `Family` names its own (`Family.decoder`). No branches in the model.
QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_id", "video_token_id"))
# GLM's processor writes every video frame as image tokens; transformers replaces image_token_id only.
GLM4 = DecoderSpec(Glm4Layer, InterleavedPairs, ("image_token_id",))
GLM_OCR = DecoderSpec(GlmOcrLayer, InterleavedPairs, ("image_token_id",))
# GLM-4.5V: dense layers before `first_k_dense_replace`, MoE layers after; rotate-half partial rotary.
GLM4V_MOE = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_id",), moe_layer=Glm4MoeLayer)
QWEN3_5 = DecoderSpec(Qwen35AttentionLayer, HalfPairs, ("image_token_id", "video_token_id"), Qwen35LinearLayer)
# MiniCPM-V 4.5's Qwen3: its image rows replace `<unk>` runs (the processor's `image_bound`).
QWEN3 = DecoderSpec(Qwen3Layer, HalfPairs, (), placeholder_tokens=("<unk>",),
                    eos_tokens=("<|im_end|>", "<|endoftext|>"), mrope=False)
# LLaVA's language models (by `text_config.model_type`): 1-D RoPE (the positions are plain 0..S-1,
# given as three equal `mrope_position_ids` rows), image rows replacing `image_token_index`.
LLAVA_LLAMA = DecoderSpec(LlamaLayer, HalfPairs, ("image_token_index",), mrope=False,
                          refused_flags=("attention_bias", "mlp_bias"))
LLAVA_QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_index",), mrope=False)


class DecoderModel:
    """The language model of a VLM checkpoint, on `device` (cpu, cuda, cuda:N) in `dtype` (float32,
    bfloat16, float16: every weight converted once, here, as transformers loads every parameter in
    the model's dtype). Not thread-safe: one caller at a time."""

    def __init__(self, config: DecoderConfig, weights: dict[str, torch.Tensor], *,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype = torch.float32, shard: Shard = Shard()):
        """`weights`: the checkpoint's (this tensor-parallel rank's parts of them: `Shard.plan`);
        `config` the whole model's, `self.config` this rank's (`Shard.config`)."""
        self.shard = shard
        self.vocab_size = config.vocab_size
        self.config = c = shard.config(config)
        self.device, self.dtype = parse_device(device), parse_dtype(dtype)
        if self.device.type == "cuda" and self.device.index is None:  # by its index, as tensors name it
            self.device = torch.device("cuda", torch.cuda.current_device())
        spec = get_family(c.family).decoder_spec(c.text_model_type)
        prefix = next((p for p in _DECODER_PREFIXES if p + "embed_tokens.weight" in weights), None)
        if prefix is None:
            raise ValueError("checkpoint has no embed_tokens.weight for the language model")

        def convert(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
            return t.to(self.device, dtype or self.dtype).contiguous()

        def w(name: str) -> torch.Tensor:
            return convert(weights[prefix + name], torch.float32 if name.endswith(_FLOAT32_WEIGHTS) else None)

        self.embed_tokens = w("embed_tokens.weight")
        self.norm = spec.layer.norm_weight(w("norm.weight"))
        head = next((weights[k] for k in _LM_HEAD_KEYS if k in weights), None)
        # this rank's vocabulary rows of the head (all of them unsplit; a view of a tied embedding)
        self.lm_head = (self.embed_tokens[shard.vocab_rows(c.vocab_size)] if (c.tie_word_embeddings or head is None)
                        else convert(head))
        self.layers = []
        self.layer_index: list[int] = []  # per layer: its index in the KV cache, or in the StateCache
        for i, (kind, moe) in enumerate(zip(c.layer_types, c.moe_layers)):
            cls = spec.layer_class(kind, moe)
            self.layers.append(cls(lambda name, i=i: w(f"layers.{i}.{name}"), c, shard))
            self.layer_index.append(sum(1 for t in c.layer_types[:i] if t == kind))
        self.rotary = Rotary(c, spec.rotary_pairing, self.device, self.dtype)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, *, device: str | torch.device = "cpu",
                        dtype: str | torch.dtype = torch.float32, shard: Shard = Shard()) -> "DecoderModel":
        """The checkpoint's decoder, or tensor-parallel rank `shard`'s part of it (only that part read)."""
        root = Path(checkpoint_dir)
        config = DecoderConfig.from_checkpoint(root)
        shard.check(config)

        def wanted(k: str) -> bool:
            """Not the vision tower's, nor a layer past the stack (GLM-4.5V's multi-token-prediction
            layers, which transformers does not load either)."""
            if "visual" in k or "vision" in k or k.startswith(_VISION_PREFIXES):
                return False
            layer = _LAYER_KEY.match(k)
            return layer is None or int(layer[1]) < config.num_layers

        def plan(name: str, shape: tuple[int, ...]):
            return shard.plan(name, shape, config)

        weights = read_safetensors(root, lambda k: k if wanted(k) else None, dtype=parse_dtype(dtype), plan=plan)
        if parse_dtype(dtype) != torch.float32:  # read again, unrounded
            weights.update(read_safetensors(root, lambda k: k if wanted(k) and k.endswith(_FLOAT32_WEIGHTS) else None,
                                            plan=plan))
        return cls(config, weights, device=device, dtype=dtype, shard=shard)

    @property
    def capturable(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph (`triton_vlm.llm.cuda_graphs`): no
        mixture-of-experts layer (its loop runs over the experts a step chose) and no linear attention."""
        return not self.config.recurrent and self.config.moe is None

    # ---- inputs --------------------------------------------------------------------------------
    def placeholder_mask(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for t in self.config.placeholder_token_ids:
            mask |= ids == t
        return mask

    def placeholder_rows(self, ids: torch.Tensor, embeddings: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The placeholder mask of `ids` and the vision rows that fill it (None when there are
        none): one [hidden_size] row per placeholder token, in order, or INVALID_ARG."""
        mask = self.placeholder_mask(ids)
        n_placeholders = int(mask.sum())
        if embeddings is not None and embeddings.numel() == 0:
            embeddings = None
        if embeddings is not None and (embeddings.ndim != 2 or embeddings.shape[1] != self.config.hidden_size):
            raise InvalidInput(f"embeddings: shape {list(embeddings.shape)}, expected "
                               f"[{n_placeholders}, {self.config.hidden_size}]")
        n_rows = 0 if embeddings is None else int(embeddings.shape[0])
        if n_rows != n_placeholders:
            raise InvalidInput(f"embeddings: {n_rows} rows given, prompt has {n_placeholders} "
                               f"image/video placeholder tokens")
        return mask, embeddings

    # ---- the batched pass ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: StepBatch, attention: "AttentionBackend", states: "StateCache | None") -> torch.Tensor:
        """One pass over every row of the step: each linear layer runs once on all rows; attention
        layers call `attention.forward` (the backend writes the rows' K/V into the paged cache and
        attends per sequence); linear-attention layers run each sequence from its slot of `states`.
        Returns the logits [len(batch.logits_rows), vocab]."""
        c, h = self.config, batch.h
        cos, sin = self.rotary.cos_sin(batch.positions)
        cos, sin = cos[:, None], sin[:, None]  # once per pass, not per layer
        for layer, li in zip(self.layers, self.layer_index):
            if layer.recurrent:
                h = layer.forward(h, batch.recurrent, states.conv[li], states.recurrent[li])
                continue
            q, k, v, gate = layer.qkv(h)
            q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
            attn = attention.forward(li, q, k, v, batch.attn)
            h = layer.finish(h, attn.view(h.shape[0], c.num_heads * c.head_dim), gate)
        logits = F.linear(_rms(h.index_select(0, batch.logits_rows), self.norm, c.rms_norm_eps), self.lm_head).float()
        return logits if self.shard.world == 1 else gather_logits(logits, self.vocab_size)
