"""The LLaVA decoders, picked by `text_config.model_type`: Llama and Qwen2 with 1-D RoPE (the
positions are plain 0..S-1, given as three equal `mrope_position_ids` rows), image rows replacing
`image_token_index`; LLaVA-OneVision's Qwen2 also replaces `video_token_index`."""
from triton_vlm.llm.layers.decoder import LlamaLayer, Qwen2Layer
from triton_vlm.llm.layers.rotary import HalfPairs
from triton_vlm.llm.layers.spec import DecoderSpec
from triton_vlm.llm.text_config import TextRules, class_defaults

# `TextRules`: the text config classes' defaults (`LlamaConfig`'s, `Qwen2Config`'s), and the LLaVA
# config classes that forward a true `text_config.tie_word_embeddings`.
LLAVA_LLAMA = DecoderSpec(LlamaLayer, HalfPairs, ("image_token_index",), mrope=False,
                          refused_flags=("attention_bias", "mlp_bias"), text=TextRules(
                              class_defaults(32000, 4096, 11008, 32, 32, None, 2048, 1e-6),
                              partial_rotary_factor=None, tie_from_text=("llava",)))
_QWEN2_TEXT = TextRules(class_defaults(151936, 4096, 22016, 32, 32, 32, 32768, 1e-6), partial_rotary_factor=None,
                        tie_from_text=("llava", "llava_onevision"))
LLAVA_QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_index",), mrope=False, text=_QWEN2_TEXT)
# LLaVA-OneVision's Qwen2: its rows replace both the image and the video placeholders.
LLAVA_ONEVISION_QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_index", "video_token_index"), mrope=False,
                                    text=_QWEN2_TEXT)

