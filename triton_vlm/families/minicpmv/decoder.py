"""The MiniCPM-V versions' decoders: 4.6's (and 4.7's, MiniCPM-OCR's) Qwen3.5 hybrid stack, and the
official `MiniCPMV` class's language models with 1-D positions, its image rows replacing `<unk>`
runs (the processor's `image_bound`): 2.0's MiniCPM, 2.5's Llama 3, 2.6's Qwen2, 4.0's Llama with
LongRoPE, 4.5's Qwen3. Their official configs are flat (`MiniCPMVConfig` subclasses the text config
class of the transformers version the official code ran on: 4.40's `LlamaConfig` for 2.5 and
`Qwen2Config` for 2.6, 4.51's `LlamaConfig` for 4.0 and `Qwen3Config` for 4.5), and the official
`chat` stops on its own terminators."""
from dataclasses import replace

from triton_vlm.families.qwen3_vl.decoder import QWEN3_5
from triton_vlm.llm.layers.decoder import LlamaLayer, Qwen2Layer, Qwen3Layer
from triton_vlm.llm.layers.rotary import HalfPairs
from triton_vlm.llm.layers.spec import DecoderSpec
from triton_vlm.llm.text_config import TextRules, class_defaults

# MiniCPM-OCR's: `MiniCPMOcrConfig` ties the word embeddings unless its config says otherwise.
QWEN3_5_TIED = replace(QWEN3_5, text=replace(QWEN3_5.text, tie_word_embeddings=True))

# The official `MiniCPMV`'s: image rows replace the `<unk>` runs; positions 0..S-1.
_OFFICIAL = DecoderSpec(Qwen3Layer, HalfPairs, (), placeholder_tokens=("<unk>",),
                        eos_tokens=("<|im_end|>", "<|endoftext|>"), mrope=False)
# 4.5: transformers 4.51's `Qwen3Config` defaults.
QWEN3 = replace(_OFFICIAL, text=TextRules(class_defaults(151936, 4096, 22016, 32, 32, 32, 32768, 1e-6, head_dim=128),
                                          partial_rotary_factor=None, flat=True))
# 2.6: transformers 4.40's `Qwen2` reads neither `head_dim` nor `rope_scaling`, and under SDPA (the
# official code's attention here) masks keys `sliding_window` back (default 4096) whatever
# `use_sliding_window` says. The official `get_vllm_embedding` scales the prompt's token embeddings
# by a config's `scale_emb` (not the generated tokens'): not implemented, refused.
QWEN2 = replace(_OFFICIAL, layer=Qwen2Layer, refused_flags=("scale_emb",), text=TextRules(
    class_defaults(151936, 4096, 22016, 32, 32, 32, 32768, 1e-6, sliding_window=4096), partial_rotary_factor=None,
    flat=True, head_dim_key=False, rope_scaling=False, sdpa_sliding_window=True))
# 4.0: transformers 4.51's `LlamaConfig` (LongRoPE in its `rope_scaling`), stopping on `</s>`.
LLAMA = replace(_OFFICIAL, layer=LlamaLayer, eos_tokens=("<|im_end|>", "</s>"),
                refused_flags=("attention_bias", "mlp_bias", "scale_emb"), text=TextRules(
                    class_defaults(32000, 4096, 11008, 32, 32, None, 2048, 1e-6), partial_rotary_factor=None,
                    flat=True))
# 2.0: MiniCPM-2.4B (`MiniCPMForCausalLM` of its remote code under transformers 4.36): a Llama stack
# with muP scalings (`Scaling`), head_dim hidden_size / heads, its `MiniCPMConfig`'s defaults; stops
# on `</s>` (generation_config.json's eos) only.
MINICPM = replace(_OFFICIAL, layer=LlamaLayer, eos_tokens=(), refused_flags=("attention_bias",), text=TextRules(
    class_defaults(32000, 4096, 11008, 32, 32, None, 2048, 1e-6, scale_emb=1, scale_depth=1, dim_model_base=1),
    partial_rotary_factor=None, flat=True, head_dim_key=False, tie_word_embeddings=True, mup_scaling=True))
# 2.5: transformers 4.40's `LlamaConfig` (Llama 3's sizes and `rope_theta` in the config): it reads
# no `head_dim` (hidden_size / num_attention_heads) and no `mlp_bias`; its `rope_scaling` (linear,
# dynamic) and `attention_bias` are not implemented, refused. Stops on `<|end_of_text|>` and
# `<|eot_id|>` (the official `generate`'s terminators).
LLAMA3 = replace(_OFFICIAL, layer=LlamaLayer, eos_tokens=("<|end_of_text|>", "<|eot_id|>"),
                 refused_flags=("attention_bias", "rope_scaling", "scale_emb"), text=TextRules(
                     class_defaults(32000, 4096, 11008, 32, 32, None, 2048, 1e-6), partial_rotary_factor=None,
                     flat=True, head_dim_key=False, rope_scaling=False))
