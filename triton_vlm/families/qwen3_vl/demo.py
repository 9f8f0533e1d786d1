"""Qwen3-VL's and Qwen3-VL-MoE's demo checkpoints: their sizes, reduced chat template and
random-weight writer."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from triton_vlm.families.demo import Demo, random_model
from triton_vlm.families.qwen2_5_vl.demo import QWEN_TEMPLATE  # Qwen's chat format, reduced to the demo's needs
from triton_vlm.families.qwen3_vl import QWEN3_VL
from triton_vlm.families.qwen3_vl.processor import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START

# Random-weight demo shapes. `tiny` keeps tests to seconds (a position table of 8 x 8, smaller and
# larger than the test images' grids; two DeepStack maps); `small` is tens of millions of parameters.
QWEN3_VL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, mrope_section=[2, 3, 3]),
        vision=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=64,
                    deepstack_visual_indexes=[1, 2]),
        image_pixels=(4 * 32 * 32, 64 * 32 * 32), video_pixels=(4 * 32 * 32, 8 * 16 * 32 * 32),
    ),
    "small": dict(
        vocab_size=8192,
        text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, mrope_section=[12, 10, 10]),
        vision=dict(depth=8, hidden_size=256, intermediate_size=704, num_heads=4, num_position_embeddings=576,
                    deepstack_visual_indexes=[1, 3, 5]),
        image_pixels=(16 * 32 * 32, 1024 * 32 * 32), video_pixels=(16 * 32 * 32, 8 * 256 * 32 * 32),
    ),
}
# Qwen3-VL-MoE: every layer sparse but one (`mlp_only_layers`), top-2 of 8 experts.
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
            mlp_only_layers=[1])
QWEN3_VL_MOE_SIZES: dict[str, dict[str, Any]] = {
    size: {**shape, "text": {**shape["text"], **_MOE, **({} if size == "tiny" else dict(moe_intermediate_size=256))}}
    for size, shape in QWEN3_VL_SIZES.items()}


def _writer(moe: bool):
    def write(out: Path, shape: dict[str, Any], tokenizer, seed: int) -> None:
        """Write a random-weight Qwen3-VL (MoE) checkpoint that transformers loads offline."""
        import transformers
        from transformers import GenerationConfig, Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

        config_class, model_class = (("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration") if moe
                                     else ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"))
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN3_VL.prompt.special_tokens}
        eos_ids = [ids[t] for t in QWEN3_VL.prompt.eos_tokens]
        text = dict(shape["text"])
        mrope_section = text.pop("mrope_section")
        config = getattr(transformers, config_class)(
            text_config=dict(
                vocab_size=shape["model_vocab_size"], max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=mrope_section,
                                     mrope_interleaved=True),
                bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids, pad_token_id=ids["<|endoftext|>"], **text),
            vision_config=dict(patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                               out_hidden_size=text["hidden_size"], **shape["vision"]),
            image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
            vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END], tie_word_embeddings=False)
        model = random_model(getattr(transformers, model_class), config, shape, seed)
        model.generation_config = GenerationConfig(
            bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids, pad_token_id=ids["<|endoftext|>"],
            do_sample=False)
        model.save_pretrained(out)

        (img_min, img_max), (vid_min, vid_max) = shape["image_pixels"], shape["video_pixels"]
        half = [0.5, 0.5, 0.5]
        processor = Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessor(size={"shortest_edge": img_min, "longest_edge": img_max},
                                                  patch_size=16, merge_size=2, image_mean=half, image_std=half),
            video_processor=Qwen3VLVideoProcessor(size={"shortest_edge": vid_min, "longest_edge": vid_max},
                                                  cap_pixels_per_frame=False),
            tokenizer=tokenizer, chat_template=QWEN_TEMPLATE)
        processor.save_pretrained(out)
    return write


DEMOS = {"qwen3_vl": Demo(QWEN3_VL_SIZES, _writer(moe=False)),
         "qwen3_vl_moe": Demo(QWEN3_VL_MOE_SIZES, _writer(moe=True))}
