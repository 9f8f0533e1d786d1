"""Qwen2.5-VL's decoder: Qwen2 layers with M-RoPE in rotate-half pairs; its rows replace the
image and the video placeholders."""
from triton_vlm.llm.decoders import DecoderSpec
from triton_vlm.llm.layers import Qwen2Layer
from triton_vlm.llm.rotary import HalfPairs

QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_id", "video_token_id"))
