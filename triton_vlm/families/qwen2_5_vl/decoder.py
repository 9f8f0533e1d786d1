"""Qwen2.5-VL's and Qwen2-VL's decoder: Qwen2 layers with M-RoPE in rotate-half pairs; its rows
replace the image and the video placeholders."""
from triton_vlm.llm.layers.decoder import Qwen2Layer
from triton_vlm.llm.layers.rotary import HalfPairs
from triton_vlm.llm.layers.spec import DecoderSpec
from triton_vlm.llm.text_config import TextRules, class_defaults

# `TextRules`: `Qwen2_5_VLTextConfig`'s defaults (`Qwen2VLTextConfig`'s are the same), their rotary's
# fallback `mrope_section`, and both model configs' forwarding of a true
# `text_config.tie_word_embeddings` (pre-v5 saves kept it there).
QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_id", "video_token_id"), text=TextRules(
    class_defaults(152064, 8192, 29568, 80, 64, 8, 32768, 1e-5), rope_theta=1e6, partial_rotary_factor=None,
    mrope_section=(16, 24, 24), flat=True, tie_from_text=("qwen2_5_vl", "qwen2_vl")))
