"""Qwen3-VL's decoders: Qwen3 layers (q/k RMS-normed per head, no q/k/v biases) with interleaved
M-RoPE in rotate-half pairs (transformers always interleaves, whatever `mrope_interleaved` says),
the vision rows carrying DeepStack maps added after the first layers; Qwen3-VL-MoE's sparse layers
route each token by softmax to its top-k experts, renormalised, with no shared expert.

Qwen3.5's (`qwen3_5_text`, also MiniCPM-V 4.6's and 4.7's language model): the hybrid stack of
Gated DeltaNet linear-attention layers and gated full-attention layers (`layer_types`, by default
every 4th full), (1 + w) norms, a partial rotary with interleaved M-RoPE, no DeepStack;
Qwen3.5-MoE's (`qwen3_5_moe_text`) has in every layer, of either kind, Qwen3-VL-MoE's routed experts
plus a shared expert scaled by a sigmoid gate (`GatedSharedMoe`)."""
from __future__ import annotations

from typing import Callable

import torch

from triton_vlm.families.qwen3_vl import DEEPSTACK_INDEXES
from triton_vlm.llm.layers.decoder import Qwen3Layer, Qwen35AttentionLayer, Qwen35LinearLayer, SwiGLULayer
from triton_vlm.llm.layers.moe import GatedSharedMoe, SoftmaxMoe
from triton_vlm.llm.layers.rotary import HalfPairs
from triton_vlm.llm.layers.spec import DecoderSpec
from triton_vlm.llm.text_config import TextRules, class_defaults


class Qwen3MoeLayer(Qwen3Layer):
    """A Qwen3-VL-MoE sparse layer (`Qwen3VLMoeTextDecoderLayer` with `Qwen3VLMoeTextSparseMoeBlock`):
    Qwen3's attention, the softmax-routed experts as its MLP. Its dense layers (`mlp_only_layers`,
    `decoder_sparse_step`) are `Qwen3Layer`s."""

    def init_mlp(self, w: Callable[[str], torch.Tensor]) -> None:
        self.moe = SoftmaxMoe(w, self.c.moe, self.shard.experts(self.c.moe.num_experts))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.moe(x))


_PLACEHOLDERS = ("image_token_id", "video_token_id")
# `TextRules`: the text config classes' defaults, theta and fallback `mrope_section`
# (`Qwen3VLTextRotaryEmbedding`); only the top-level `tie_word_embeddings` ties the head.
QWEN3_VL = DecoderSpec(Qwen3Layer, HalfPairs, _PLACEHOLDERS, deepstack_indexes=DEEPSTACK_INDEXES,
                      refused_flags=("attention_bias",), text=TextRules(
    class_defaults(151936, 4096, 22016, 32, 32, 32, 128000, 1e-6, head_dim=128), rope_theta=500000.0,
    mrope_section=(24, 20, 20), mrope_interleaved=True))
QWEN3_VL_MOE = DecoderSpec(
    Qwen3Layer, HalfPairs, _PLACEHOLDERS, moe_layer=Qwen3MoeLayer, deepstack_indexes=DEEPSTACK_INDEXES,
    refused_flags=("attention_bias",),
    text=TextRules(class_defaults(151936, 2048, 5632, 24, 16, 16, 128000, 1e-6, num_experts=60,
                                  num_experts_per_tok=4, moe_intermediate_size=1408, decoder_sparse_step=1),
                   rope_theta=500000.0, mrope_section=(24, 20, 20), mrope_interleaved=True))


class _GatedSharedMoeMlp(SwiGLULayer):
    """The MLP of every Qwen3.5-MoE layer (`Qwen3_5MoeDecoderLayer.mlp`), mixed into its two layer kinds."""

    def init_mlp(self, w: Callable[[str], torch.Tensor]) -> None:
        self.moe = GatedSharedMoe(w, self.c.moe, self.shard.experts(self.c.moe.num_experts))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.moe(x))


class Qwen35MoeAttentionLayer(_GatedSharedMoeMlp, Qwen35AttentionLayer):
    """A Qwen3.5-MoE full-attention layer: Qwen3.5's gated attention, the MoE as its MLP."""


class Qwen35MoeLinearLayer(_GatedSharedMoeMlp, Qwen35LinearLayer):
    """A Qwen3.5-MoE linear-attention layer: the Gated DeltaNet mixer, the MoE as its MLP."""


_QWEN3_5_LINEAR = dict(linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_conv_kernel_dim=4)
# `attention_bias` (biases on q/k/v/o_proj) is not implemented: a config setting it is refused.
QWEN3_5 = DecoderSpec(
    Qwen35AttentionLayer, HalfPairs, _PLACEHOLDERS, Qwen35LinearLayer, refused_flags=("attention_bias",),
    text=TextRules(class_defaults(248320, 4096, 12288, 32, 16, 4, 32768, 1e-6, head_dim=256, **_QWEN3_5_LINEAR),
                   full_attention_interval=4, partial_rotary_factor=0.25, mrope_section=(11, 11, 10),
                   mrope_interleaved=True))
# `Qwen3_5MoeTextConfig` has no `intermediate_size` (no layer is dense): the shared expert's width
# stands for it where a row's MLP width is estimated. Its model never reads Qwen3-VL-MoE's
# `mlp_only_layers` (every layer is sparse): a config setting some is refused.
QWEN3_5_MOE = DecoderSpec(
    Qwen35AttentionLayer, HalfPairs, _PLACEHOLDERS, Qwen35LinearLayer, moe_layer=Qwen35MoeAttentionLayer,
    moe_linear_layer=Qwen35MoeLinearLayer, refused_flags=("attention_bias", "mlp_only_layers"),
    text=TextRules(class_defaults(248320, 2048, 512, 40, 16, 2, 32768, 1e-6, head_dim=256, **_QWEN3_5_LINEAR,
                                  num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                  shared_expert_intermediate_size=512),
                   full_attention_interval=4, partial_rotary_factor=0.25, mrope_section=(11, 11, 10),
                   mrope_interleaved=True))
