"""The MiniCPM-V versions' decoders: 4.6's (and 4.7's, MiniCPM-OCR's) Qwen3.5 hybrid stack, and
4.5's Qwen3 with 1-D positions."""
from dataclasses import replace

from triton_vlm.llm.layers.decoder import Qwen3Layer, Qwen35AttentionLayer, Qwen35LinearLayer
from triton_vlm.llm.layers.rotary import HalfPairs
from triton_vlm.llm.layers.spec import DecoderSpec
from triton_vlm.llm.text_config import TextRules, class_defaults

QWEN3_5 = DecoderSpec(Qwen35AttentionLayer, HalfPairs, ("image_token_id", "video_token_id"), Qwen35LinearLayer,
                      text=TextRules(class_defaults(248320, 4096, 12288, 32, 16, 4, 32768, 1e-6, head_dim=256,
                                                    linear_key_head_dim=128, linear_value_head_dim=128,
                                                    linear_num_key_heads=16, linear_num_value_heads=32,
                                                    linear_conv_kernel_dim=4),
                                     full_attention_interval=4, partial_rotary_factor=0.25, mrope_section=(11, 11, 10),
                                     mrope_interleaved=True))
# MiniCPM-OCR's: `MiniCPMOcrConfig` ties the word embeddings unless its config says otherwise.
QWEN3_5_TIED = replace(QWEN3_5, text=replace(QWEN3_5.text, tie_word_embeddings=True))
# MiniCPM-V 4.5's Qwen3: its image rows replace `<unk>` runs (the processor's `image_bound`). The
# official `MiniCPMVConfig` is a flat Qwen3 config (transformers 4.51's `Qwen3Config` defaults).
QWEN3 = DecoderSpec(Qwen3Layer, HalfPairs, (), placeholder_tokens=("<unk>",),
                    eos_tokens=("<|im_end|>", "<|endoftext|>"), mrope=False, text=TextRules(
                        class_defaults(151936, 4096, 22016, 32, 32, 32, 32768, 1e-6, head_dim=128),
                        partial_rotary_factor=None, flat=True))

