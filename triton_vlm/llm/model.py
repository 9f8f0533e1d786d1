"""`DecoderModel`: a family's decoder, read from a Hugging Face checkpoint (a tensor-parallel
rank's share of its weights), in float32, bfloat16 or float16 on CPU or CUDA, and its batched pass.

What differs per family is data: the `DecoderSpec` its `Family` names (its folder's `decoder.py`;
`triton_vlm.llm.layers.spec`): the layer classes (`triton_vlm.llm.layers.decoder`, or the family's
own), how rotary dims pair up (`triton_vlm.llm.layers.rotary`), which token ids are image/video
placeholders, the layer class of linear-attention and mixture-of-experts layers; every size,
token id, eos id, rope theta, `mrope_section` and `partial_rotary_factor` comes from the
checkpoint's files (`triton_vlm.llm.config`). It follows transformers' text models closely enough
that greedy tokens equal Hugging Face's. Rotary frequencies split by `mrope_section` over the
temporal / height / width axes, in runs (t.., h.., w..) or interleaved (t, h, w, t, h, w, ...:
`mrope_interleaved`); 1-D RoPE is the one-section case, turned by the first of the three position
rows, which `preprocess` sends equal. Layers past `num_hidden_layers` (a multi-token-prediction
layer) are not loaded.

In bfloat16 / float16 the numerics are transformers' in that dtype (`from_pretrained(dtype=...)`):
every weight is rounded to the dtype once, at load (but those transformers keeps in float32,
`_FLOAT32_WEIGHTS`); RMSNorms compute in float32 and cast back where transformers' do (`_rms`);
rotary angles, cos and sin are float32, cast to the dtype before they rotate; attention runs through
SDPA in the dtype; the linear-attention layers and the MoE router keep transformers' float32 islands
(`triton_vlm.llm.layers.linear_attention`, `triton_vlm.llm.layers.moe`); logits come out of lm_head
in the dtype and are returned as float32 (as `generate` takes them).
`forward` runs one flat batch of token rows from many sequences (prefill chunks and decode tokens
together, `StepBatch`) through every linear layer at once; attention goes through the backend the
model runner passes (`triton_vlm.llm.attention`: paged K/V, attention per sequence).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from triton_vlm.devices import parse_device, parse_dtype
from triton_vlm.errors import InvalidInput
from triton_vlm.families import get_family
from triton_vlm.llm.config import DecoderConfig
from triton_vlm.llm.distributed.collectives import gather_logits
from triton_vlm.llm.distributed.sharding import Shard
from triton_vlm.llm.layers.decoder import _rms
from triton_vlm.llm.layers.linear_attention import RecurrentRows
from triton_vlm.llm.layers.rotary import Rotary
from triton_vlm.weights import read_safetensors

if TYPE_CHECKING:
    from triton_vlm.llm.attention.base import AttentionBackend
    from triton_vlm.llm.attention.cache import StateCache

# Where the language model's weights live, newest layout first (v5 writes either).
_DECODER_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "language_model.", "llm.model.")
_LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight", "llm.lm_head.weight")
# A decoder layer's weights: (prefix, layer index).
_LAYER_KEY = re.compile("^(?:" + "|".join(map(re.escape, _DECODER_PREFIXES)) + r")layers\.(\d+)\.")
# Weights transformers keeps in float32 whatever the model's dtype (`_keep_in_fp32_modules_strict`).
_FLOAT32_WEIGHTS = ("e_score_correction_bias",)
# Vision weights whose names say neither "visual" nor "vision" (remote-code checkpoints: `vpm`, `resampler`).
_VISION_PREFIXES = ("mlp1", "model.merger.", "vpm.", "resampler.", "model.multi_modal_projector.",
                    "multi_modal_projector.")



@dataclass
class DeepStack:
    """A step's DeepStack maps: the rows of the step that are vision rows of a prompt (prefill only)
    and, per map, what is added to them after decoder layer i (`DecoderConfig.deepstack_maps`)."""
    rows: torch.Tensor                 # [R] long
    maps: torch.Tensor                 # [maps, R, hidden], the model's dtype


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
    deepstack: DeepStack | None = None  # none: no vision row in the step, or a decoder without DeepStack



def decoder_weight(key: str, config: DecoderConfig) -> bool:
    """Whether checkpoint tensor `key` is the decoder's: not the vision tower's, nor a layer past the
    stack (a multi-token-prediction layer, which transformers does not load either)."""
    if "visual" in key or "vision" in key or key.startswith(_VISION_PREFIXES):
        return False
    layer = _LAYER_KEY.match(key)
    return layer is None or int(layer[1]) < config.num_layers


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
        if head is None and not c.tie_word_embeddings:
            raise ValueError("checkpoint has no lm_head.weight and its config does not tie the word embeddings")
        # this rank's vocabulary rows of the head (all of them unsplit; a view of a tied embedding). A
        # head the checkpoint holds is the head even where the config ties it to the embedding: so
        # does transformers, which ties only a head that is missing or equal to the embedding.
        self.lm_head = self.embed_tokens[shard.vocab_rows(c.vocab_size)] if head is None else convert(head)
        if c.scaling.embedding != 1.0:  # every token's embedding scaled (a gather of a scaled table is exact)
            scale = c.scaling.embedding
            self.embed_tokens = self.embed_tokens * (torch.tensor(scale, dtype=self.dtype) if c.scaling.embedding_in_dtype
                                                     else scale)
        self.layers = []
        self.layer_index: list[int] = []  # per layer: its index in the KV cache, or in the StateCache
        for i, (kind, moe) in enumerate(zip(c.layer_types, c.moe_layers)):
            cls = spec.layer_class(kind, moe)
            self.layers.append(cls(lambda name, i=i: w(f"layers.{i}.{name}"), c, shard))
            self.layer_index.append(sum(1 for t in c.layer_types[:i] if (t == "linear_attention") == (kind == "linear_attention")))
        self.rotary = Rotary(c, spec.rotary_pairing, self.device, self.dtype, linear_factor=c.rope_linear_factor)
        # sliding-window layers with a rotary of their own (Gemma 3's `rope_local_base_freq`)
        sliding = self.rotary if c.sliding_rope_theta is None else Rotary(
            c, spec.rotary_pairing, self.device, self.dtype, theta=c.sliding_rope_theta)
        self.layer_rotary = [sliding if kind == "sliding_attention" else self.rotary for kind in c.layer_types]

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, *, device: str | torch.device = "cpu",
                        dtype: str | torch.dtype = torch.float32, shard: Shard = Shard()) -> "DecoderModel":
        """The checkpoint's decoder, or tensor-parallel rank `shard`'s part of it (only that part read)."""
        root = Path(checkpoint_dir)
        config = DecoderConfig.from_checkpoint(root)
        shard.check(config)

        def wanted(k: str) -> bool:
            return decoder_weight(k, config)

        def plan(name: str, shape: tuple[int, ...]):
            return shard.plan(name, shape, config)

        weights = read_safetensors(root, lambda k: k if wanted(k) else None, dtype=parse_dtype(dtype), plan=plan)
        if parse_dtype(dtype) != torch.float32:  # read again, unrounded
            weights.update(read_safetensors(root, lambda k: k if wanted(k) and k.endswith(_FLOAT32_WEIGHTS) else None,
                                            plan=plan))
        return cls(config, weights, device=device, dtype=dtype, shard=shard)

    @property
    def capturable(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph (`triton_vlm.llm.engine.cuda_graphs`): no
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
        none): one row per placeholder token, in order, `embedding_width` wide (the input
        embedding, then the DeepStack maps), or INVALID_ARG."""
        mask = self.placeholder_mask(ids)
        n_placeholders = int(mask.sum())
        if embeddings is not None and embeddings.numel() == 0:
            embeddings = None
        width = self.config.embedding_width
        if embeddings is not None and (embeddings.ndim != 2 or embeddings.shape[1] != width):
            raise InvalidInput(f"embeddings: shape {list(embeddings.shape)}, expected [{n_placeholders}, {width}]")
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
        angles = {}  # cos, sin of each distinct rotary, once per pass, not per layer
        for rotary in dict.fromkeys(self.layer_rotary):
            cos, sin = rotary.cos_sin(batch.positions)
            angles[rotary] = cos[:, None], sin[:, None]
        deepstack = batch.deepstack
        for i, (layer, li, rotary) in enumerate(zip(self.layers, self.layer_index, self.layer_rotary)):
            if layer.recurrent:
                h = layer.forward(h, batch.recurrent, states.conv[li], states.recurrent[li])
            else:
                q, k, v, gate = layer.qkv(h)
                cos, sin = angles[rotary]
                q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
                attn = attention.forward(li, q, k, v, batch.attn)
                h = layer.finish(h, attn.view(h.shape[0], c.num_heads * c.head_dim), gate)
            if deepstack is not None and i < deepstack.maps.shape[0]:  # Qwen3VLTextModel._deepstack_process
                h = h.index_add(0, deepstack.rows, deepstack.maps[i])
        h = _rms(h.index_select(0, batch.logits_rows), self.norm, c.rms_norm_eps)
        if c.scaling.logits_divisor != 1.0:
            h = h / c.scaling.logits_divisor
        logits = F.linear(h, self.lm_head).float()
        return logits if self.shard.world == 1 else gather_logits(logits, self.vocab_size)
