"""The families' decoders as data: a `DecoderSpec` per decoder (its layer classes, rotary pairing,
placeholder and stop tokens), which each `Family` names (`Family.decoder`). No branches in the model."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from triton_vlm.llm.layers import (Glm4Layer, Glm4MoeLayer, GlmOcrLayer, LlamaLayer, Qwen2Layer, Qwen3Layer,
                                   Qwen35AttentionLayer, Qwen35LinearLayer)
from triton_vlm.llm.rotary import HalfPairs, InterleavedPairs
from triton_vlm.llm.text_config import TextRules


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
    # How its transformers config classes read what config.json leaves out or spells otherwise.
    text: TextRules = field(default_factory=TextRules)

    def layer_class(self, layer_type: str, moe: bool) -> type:
        """The class of a layer of `layer_type` (config `layer_types`) whose MLP is (`moe`) or is
        not a mixture of experts."""
        if layer_type == "linear_attention":
            return self.linear_layer
        return self.moe_layer if moe else self.layer


def _sizes(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int | None,
           max_positions: int, eps: float, **more) -> dict:
    """A text config class's defaults (`TextRules.defaults`)."""
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                rms_norm_eps=eps, **more)


# The families' decoders; each `Family` names its own (`Family.decoder`). No branches in the model.
# `TextRules`: the transformers text config class's defaults (`Qwen2_5_VLTextConfig`, ...), its
# rotary's fallback `mrope_section`, and the top-level config classes that forward a true
# `text_config.tie_word_embeddings` (their pre-v5 saves kept it there).
QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_id", "video_token_id"), text=TextRules(
    _sizes(152064, 8192, 29568, 80, 64, 8, 32768, 1e-5), rope_theta=1e6, partial_rotary_factor=None,
    mrope_section=(16, 24, 24), flat=True, tie_from_text=("qwen2_5_vl",)))
# GLM's processor writes every video frame as image tokens; transformers replaces image_token_id only.
# `Glm4vConfig` forwards the text config's tie; `Glm46VConfig` and `GlmgaConfig` do not.
GLM4 = DecoderSpec(Glm4Layer, InterleavedPairs, ("image_token_id",), text=TextRules(
    _sizes(151552, 4096, 13696, 40, 32, 2, 32768, 1e-5), mrope_section=(8, 12, 12), tie_from_text=("glm4v",)))
GLM_OCR = DecoderSpec(GlmOcrLayer, InterleavedPairs, ("image_token_id",), text=TextRules(
    _sizes(59392, 1024, 4096, 16, 16, 8, 131072, 1e-5), mrope_section=(8, 12, 12), tie_from_text=("glm_ocr",)))
# GLM-4.5V: dense layers before `first_k_dense_replace`, MoE layers after; rotate-half partial rotary.
GLM4V_MOE = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_id",), moe_layer=Glm4MoeLayer, text=TextRules(
    _sizes(151424, 4096, 10944, 46, 96, 8, 65536, 1e-5, n_routed_experts=128, num_experts_per_tok=8,
           moe_intermediate_size=1408), partial_rotary_factor=0.5, mrope_section=(8, 12, 12),
    tie_from_text=("glm4v_moe",)))
QWEN3_5 = DecoderSpec(Qwen35AttentionLayer, HalfPairs, ("image_token_id", "video_token_id"), Qwen35LinearLayer,
                      text=TextRules(_sizes(248320, 4096, 12288, 32, 16, 4, 32768, 1e-6, head_dim=256,
                                            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                                            linear_num_value_heads=32, linear_conv_kernel_dim=4),
                                     full_attention_interval=4, partial_rotary_factor=0.25, mrope_section=(11, 11, 10),
                                     mrope_interleaved=True))
# MiniCPM-OCR's: `MiniCPMOcrConfig` ties the word embeddings unless its config says otherwise.
QWEN3_5_TIED = replace(QWEN3_5, text=replace(QWEN3_5.text, tie_word_embeddings=True))
# MiniCPM-V 4.5's Qwen3: its image rows replace `<unk>` runs (the processor's `image_bound`). The
# official `MiniCPMVConfig` is a flat Qwen3 config (transformers 4.51's `Qwen3Config` defaults).
QWEN3 = DecoderSpec(Qwen3Layer, HalfPairs, (), placeholder_tokens=("<unk>",),
                    eos_tokens=("<|im_end|>", "<|endoftext|>"), mrope=False, text=TextRules(
                        _sizes(151936, 4096, 22016, 32, 32, 32, 32768, 1e-6, head_dim=128),
                        partial_rotary_factor=None, flat=True))
# LLaVA's language models (by `text_config.model_type`): 1-D RoPE (the positions are plain 0..S-1,
# given as three equal `mrope_position_ids` rows), image rows replacing `image_token_index`.
LLAVA_LLAMA = DecoderSpec(LlamaLayer, HalfPairs, ("image_token_index",), mrope=False,
                          refused_flags=("attention_bias", "mlp_bias"), text=TextRules(
                              _sizes(32000, 4096, 11008, 32, 32, None, 2048, 1e-6), partial_rotary_factor=None,
                              tie_from_text=("llava",)))
_QWEN2_TEXT = TextRules(_sizes(151936, 4096, 22016, 32, 32, 32, 32768, 1e-6), partial_rotary_factor=None,
                        tie_from_text=("llava", "llava_onevision"))
LLAVA_QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_index",), mrope=False, text=_QWEN2_TEXT)
# LLaVA-OneVision's Qwen2: its rows replace both the image and the video placeholders.
LLAVA_ONEVISION_QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_index", "video_token_index"), mrope=False,
                                    text=_QWEN2_TEXT)
