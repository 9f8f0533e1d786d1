"""The LLaVA decoders, picked by `text_config.model_type`: Llama and Qwen2 with 1-D RoPE (the
positions are plain 0..S-1, given as three equal `mrope_position_ids` rows), image rows replacing
`image_token_index`; LLaVA-OneVision's Qwen2 also replaces `video_token_index`."""
from triton_vlm.llm.layers.decoder import LlamaLayer, Qwen2Layer
from triton_vlm.llm.layers.rotary import HalfPairs
from triton_vlm.llm.layers.spec import DecoderSpec

LLAVA_LLAMA = DecoderSpec(LlamaLayer, HalfPairs, ("image_token_index",), mrope=False,
                          refused_flags=("attention_bias", "mlp_bias"))
LLAVA_QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_index",), mrope=False)
# LLaVA-OneVision's Qwen2: its rows replace both the image and the video placeholders.
LLAVA_ONEVISION_QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_index", "video_token_index"), mrope=False)

