"""The MiniCPM-V versions' decoders: 4.6's (and 4.7's, MiniCPM-OCR's) Qwen3.5 hybrid stack, and
4.5's Qwen3 with 1-D positions."""
from triton_vlm.llm.layers.decoder import Qwen3Layer, Qwen35AttentionLayer, Qwen35LinearLayer
from triton_vlm.llm.layers.rotary import HalfPairs
from triton_vlm.llm.layers.spec import DecoderSpec

QWEN3_5 = DecoderSpec(Qwen35AttentionLayer, HalfPairs, ("image_token_id", "video_token_id"), Qwen35LinearLayer)
# MiniCPM-V 4.5's Qwen3: its image rows replace `<unk>` runs (the processor's `image_bound`).
QWEN3 = DecoderSpec(Qwen3Layer, HalfPairs, (), placeholder_tokens=("<unk>",),
                    eos_tokens=("<|im_end|>", "<|endoftext|>"), mrope=False)

