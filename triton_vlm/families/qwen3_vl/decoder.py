"""Qwen3-VL's decoders: Qwen3 layers (q/k RMS-normed per head, no q/k/v biases) with interleaved
M-RoPE in rotate-half pairs (transformers always interleaves, whatever `mrope_interleaved` says),
the vision rows carrying DeepStack maps added after the first layers; Qwen3-VL-MoE's sparse layers
route each token by softmax to its top-k experts, renormalised, with no shared expert."""
from __future__ import annotations

from typing import Callable

import torch

from triton_vlm.families.qwen3_vl import DEEPSTACK_INDEXES
from triton_vlm.llm.layers.decoder import Qwen3Layer
from triton_vlm.llm.layers.moe import SoftmaxMoe
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
