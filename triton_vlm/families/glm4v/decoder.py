"""The GLM variants' decoders: GLM-4's layer (Qwen2's attention and MLP, each output RMS-normed
again before its residual add) with partial rotary in interleaved pairs, GLM-OCR's without q/k/v
biases, and GLM-4.5V's mixture of experts in rotate-half pairs."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from triton_vlm.llm.config import DecoderConfig
from triton_vlm.llm.distributed.sharding import Shard
from triton_vlm.llm.layers.decoder import Qwen2Layer, _rms
from triton_vlm.llm.layers.moe import SparseMoe
from triton_vlm.llm.layers.rotary import HalfPairs, InterleavedPairs
from triton_vlm.llm.layers.spec import DecoderSpec
from triton_vlm.llm.text_config import TextRules, class_defaults


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
    on): Qwen2's attention and norms; the MLP is `Glm4vMoeTextMoE` (`triton_vlm.llm.layers.moe.SparseMoe`).
    GLM-4.5V's dense layers are `Qwen2Layer`s."""

    def init_mlp(self, w: Callable[[str], torch.Tensor]) -> None:
        self.moe = SparseMoe(w, self.c.moe, self.shard.experts(self.c.moe.num_experts))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.moe(x))



# GLM's processor writes every video frame as image tokens; transformers replaces image_token_id only.
# `TextRules`: the transformers text config class's defaults, its rotary's fallback `mrope_section`;
# `Glm4vConfig` forwards the text config's tie, `Glm46VConfig` and `GlmgaConfig` do not.
GLM4 = DecoderSpec(Glm4Layer, InterleavedPairs, ("image_token_id",), text=TextRules(
    class_defaults(151552, 4096, 13696, 40, 32, 2, 32768, 1e-5), mrope_section=(8, 12, 12), tie_from_text=("glm4v",)))
GLM_OCR = DecoderSpec(GlmOcrLayer, InterleavedPairs, ("image_token_id",), text=TextRules(
    class_defaults(59392, 1024, 4096, 16, 16, 8, 131072, 1e-5), mrope_section=(8, 12, 12),
    tie_from_text=("glm_ocr",)))
# GLM-4.5V: dense layers before `first_k_dense_replace`, MoE layers after; rotate-half partial rotary.
GLM4V_MOE = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_id",), moe_layer=Glm4MoeLayer, text=TextRules(
    class_defaults(151424, 4096, 10944, 46, 96, 8, 65536, 1e-5, n_routed_experts=128, num_experts_per_tok=8,
                   moe_intermediate_size=1408), partial_rotary_factor=0.5, mrope_section=(8, 12, 12),
    tie_from_text=("glm4v_moe",)))

