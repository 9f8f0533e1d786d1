"""`DecoderSpec`: a decoder as data (its layer classes, rotary pairing, placeholder and stop
tokens). Each family folder's `decoder.py` holds its specs, which its `Family` names
(`Family.decoder`); the model takes them as they are, with no branch on a family."""
from __future__ import annotations

from dataclasses import dataclass, field

from triton_vlm.llm.text_config import TextRules


@dataclass(frozen=True)
class DecoderSpec:
    """What one family's decoder is made of: its (attention) layer class, how its rotary dims pair
    up, the config keys of the token ids its prompts hold image/video placeholders under, the
    layer class of its `linear_attention` layers (hybrid stacks; config `layer_types`) and of its
    mixture-of-experts layers (`DecoderConfig.moe_layers`), and of linear-attention layers whose MLP
    is a mixture of experts (Qwen3.5-MoE)."""
    layer: type
    rotary_pairing: type  # HalfPairs or InterleavedPairs
    placeholder_keys: tuple[str, ...]
    linear_layer: type | None = None
    moe_layer: type | None = None
    moe_linear_layer: type | None = None
    # Placeholder tokens by their text, for checkpoints whose config names none (e.g.
    # `<unk>`), looked up in the tokenizer's added tokens.
    placeholder_tokens: tuple[str, ...] = ()
    # Stop tokens by their text, beside the config's eos ids (an official chat that passes
    # `<|im_end|>` and `<|endoftext|>` as terminators; its config names the first only).
    eos_tokens: tuple[str, ...] = ()
    # False: 1-D RoPE (the config has no mrope_section); the first position row turns every dim.
    mrope: bool = True
    # Text config flags this decoder does not implement: a checkpoint that sets one is refused.
    refused_flags: tuple[str, ...] = ()
    # The MLP activation its layers implement (config `TextRules.activation_key`; others refused).
    activation: str = "silu"
    # In prefill the tokens of one media run attend to each other both ways (Gemma 3's image blocks).
    bidirectional_media: bool = False
    # How its transformers config classes read what config.json leaves out or spells otherwise.
    text: TextRules = field(default_factory=TextRules)
    # DeepStack (Qwen3-VL): each vision row carries, beside its input embedding, one feature map per
    # `vision_config.deepstack_visual_indexes` entry (these: the vision config class's default), the
    # i-th added to the row's hidden state after decoder layer i. None: the rows carry none.
    deepstack_indexes: tuple[int, ...] | None = None

    def layer_class(self, layer_type: str, moe: bool) -> type:
        """The class of a layer of `layer_type` (config `layer_types`) whose MLP is (`moe`) or is
        not a mixture of experts."""
        if layer_type == "linear_attention":
            return self.moe_linear_layer if moe else self.linear_layer
        return self.moe_layer if moe else self.layer
