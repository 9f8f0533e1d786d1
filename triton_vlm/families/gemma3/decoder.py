"""The Gemma 3 decoder (`Gemma3TextModel`): Qwen3's attention (q/k RMS-normed per head, no biases)
with the attention scale `query_pre_attn_scalar` ** -1/2, four (1 + w) RMSNorms a layer (input,
post-attention, pre- and post-feedforward: the attention and MLP outputs are normed before their
residual adds), a gated gelu_tanh MLP, token embeddings scaled by sqrt(hidden_size) (image rows
not), sliding-window layers (`sliding_window`, 5 to each full one where `layer_types` is left out)
with their own rotary (`rope_local_base_freq`), linear scaling on the full layers', and in prefill
the tokens of each image block (a run of `<image_soft_token>`) attending to each other both ways
(`DecoderSpec.bidirectional_media`; within the window on sliding layers)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from triton_vlm.llm.config import DecoderConfig
from triton_vlm.llm.distributed.sharding import Shard
from triton_vlm.llm.layers.decoder import Qwen3Layer, _rms
from triton_vlm.llm.layers.rotary import HalfPairs
from triton_vlm.llm.layers.spec import DecoderSpec
from triton_vlm.llm.text_config import TextRules, class_defaults


class Gemma3Layer(Qwen3Layer):
    """`Gemma3DecoderLayer`: input_layernorm, attention, post_attention_layernorm, residual;
    pre_feedforward_layernorm, gelu_tanh(gate) * up, down, post_feedforward_layernorm, residual."""
    norm_offset = 1.0

    def __init__(self, w: Callable[[str], torch.Tensor], config: DecoderConfig, shard: Shard = Shard()):
        super().__init__(w, config, shard)
        self.ln_pre_mlp = self.norm_weight(w("pre_feedforward_layernorm.weight"))
        self.ln_post_mlp = self.norm_weight(w("post_feedforward_layernorm.weight"))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w_gate_up).chunk(2, dim=-1)
        return self.reduce(F.linear(F.gelu(gate, approximate="tanh") * up, self.w_down))

    def finish(self, h: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        eps = self.c.rms_norm_eps
        h = h + _rms(self.reduce(F.linear(attn, self.wo)), self.ln2, eps)
        return h + _rms(self.mlp(_rms(h, self.ln_pre_mlp, eps)), self.ln_post_mlp, eps)


# `Gemma3TextConfig`'s defaults; the model ties its head to the embedding.
GEMMA3_TEXT = DecoderSpec(
    Gemma3Layer, HalfPairs, ("image_token_index",), mrope=False, activation="gelu_pytorch_tanh",
    bidirectional_media=True, eos_tokens=("<end_of_turn>",),
    refused_flags=("attention_bias", "attn_logit_softcapping", "final_logit_softcapping",
                   "use_bidirectional_attention"),
    text=TextRules(class_defaults(262208, 2304, 9216, 26, 8, 4, 131072, 1e-6, head_dim=256, sliding_window=4096,
                                  query_pre_attn_scalar=256),
                   rope_theta=1000000.0, partial_rotary_factor=None, tie_word_embeddings=True,
                   sliding_layers=True, sliding_window_pattern=6, local_rope_theta=10000.0,
                   activation_key="hidden_activation", attention_scale_key="query_pre_attn_scalar",
                   sqrt_hidden_embedding=True))
