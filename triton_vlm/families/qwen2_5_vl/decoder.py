"""Qwen2.5-VL's decoder: Qwen2 layers with M-RoPE in rotate-half pairs; its rows replace the
image and the video placeholders."""
from triton_vlm.llm.layers.decoder import Qwen2Layer
from triton_vlm.llm.layers.rotary import HalfPairs
from triton_vlm.llm.layers.spec import DecoderSpec

QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_id", "video_token_id"))
