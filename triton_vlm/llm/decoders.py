"""The families' decoders as data: a `DecoderSpec` per decoder (its layer classes, rotary pairing,
placeholder and stop tokens), which each `Family` names (`Family.decoder`). No branches in the model."""
from __future__ import annotations

from dataclasses import dataclass

from triton_vlm.llm.layers import (Glm4Layer, Glm4MoeLayer, GlmOcrLayer, LlamaLayer, Qwen2Layer, Qwen3Layer,
                                   Qwen35AttentionLayer, Qwen35LinearLayer)
from triton_vlm.llm.rotary import HalfPairs, InterleavedPairs


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
# LLaVA-OneVision's Qwen2: its rows replace both the image and the video placeholders.
LLAVA_ONEVISION_QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_index", "video_token_index"), mrope=False)
