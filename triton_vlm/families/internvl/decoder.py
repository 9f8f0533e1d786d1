"""InternVL's decoders, picked by `text_config.model_type`: Qwen2 (InternVL3) and Qwen3 (InternVL3.5,
q/k RMS-normed per head) with 1-D RoPE (positions 0..S-1 as three equal `mrope_position_ids` rows);
image rows replace `image_token_id` (`<IMG_CONTEXT>`, in images and video frames alike)."""
from triton_vlm.llm.layers.decoder import Qwen2Layer, Qwen3Layer
from triton_vlm.llm.layers.rotary import HalfPairs
from triton_vlm.llm.layers.spec import DecoderSpec
from triton_vlm.llm.text_config import TextRules, class_defaults

# `TextRules`: transformers 5's `Qwen2Config` / `Qwen3Config` defaults; `InternVLConfig` ties the
# word embeddings unless its config says otherwise.
QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_id",), mrope=False, text=TextRules(
    class_defaults(151936, 4096, 22016, 32, 32, 32, 32768, 1e-6), partial_rotary_factor=None,
    tie_word_embeddings=True))
QWEN3 = DecoderSpec(Qwen3Layer, HalfPairs, ("image_token_id",), mrope=False, refused_flags=("attention_bias",),
                    text=TextRules(class_defaults(151936, 4096, 22016, 32, 32, 32, 32768, 1e-6, head_dim=128),
                                   partial_rotary_factor=None, tie_word_embeddings=True))
