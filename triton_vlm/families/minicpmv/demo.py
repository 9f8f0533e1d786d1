"""The demo checkpoints of the MiniCPM-V versions transformers has classes for (4.6, 4.7 and
MiniCPM-OCR): their sizes, reduced chat template and random-weight writer (the remote-code
versions' are `demo_remote_code`'s)."""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from triton_vlm.families.demo import Demo, chat_template, random_model
from triton_vlm.families.minicpmv import MINICPMV4_6
from triton_vlm.families.minicpmv import v4_6 as mc
from triton_vlm.families.minicpmv.slicing import IMAGE_END, IMAGE_START, SLICE_END, SLICE_START

MINICPMV_TEMPLATE = chat_template(
    prefix="", message_start="<|im_start|>{{ message['role'] }}\n", message_end="<|im_end|>\n",
    image=mc.IMAGE_TOKEN, video=mc.VIDEO_TOKEN, generation_prompt="<|im_start|>assistant\n")


# MiniCPM-V 4.6: the text stack alternates linear-attention (gated delta rule) and full-attention
# layers as Qwen3.5 does (`full_attention_interval`); the vision tower inserts its window-attention
# merger after `insert_layer_id`.
MINICPMV4_6_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, mrope_section=[2, 1, 1]),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=224, patch_size=14),
        insert_layer_id=0, scale_resolution=112, max_slice_nums=4,
    ),
    "small": dict(
        vocab_size=8192,
        text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                  linear_num_key_heads=4, linear_num_value_heads=8, mrope_section=[4, 2, 2]),
        vision=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4,
                    image_size=448, patch_size=14),
        insert_layer_id=3, scale_resolution=448, max_slice_nums=9,
    ),
}


# MiniCPM-OCR: MiniCPM-V 4.6's shapes, documents read in "4x" and small images and slices sized by
# their glyphs ("adaptive").
MINICPM_OCR_SIZES: dict[str, dict[str, Any]] = {
    size: {**shape, "small_image_upsize": "adaptive"} for size, shape in MINICPMV4_6_SIZES.items()}


# transformers class prefix, image and video processor classes of the MiniCPM-V variants written
# by `_write_minicpmv`: 4.7 processes pixels with 4.6's processors, MiniCPM-OCR with its own.
MINICPMV_CLASSES = {
    "minicpmv4_6": ("MiniCPMV4_6", "MiniCPMV4_6ImageProcessor", "MiniCPMV4_6VideoProcessor"),
    "minicpmv4_7": ("MiniCPMV4_7", "MiniCPMV4_6ImageProcessor", "MiniCPMV4_6VideoProcessor"),
    "minicpm_ocr": ("MiniCPMOcr", "MiniCPMOcrImageProcessor", "MiniCPMOcrVideoProcessor"),
}


def _write_minicpmv(out: Path, shape: dict[str, Any], tokenizer, seed: int, *, variant: str) -> None:
    """Write a random-weight MiniCPM-V 4.6 / 4.7 or MiniCPM-OCR checkpoint that transformers loads
    offline (4.7: its config also names the canvas M-RoPE markers, as the conversion script stores
    them; OCR: tied word embeddings, as its config class defaults). A shape's `downsample_mode`
    goes to the model and both processors, its `small_image_upsize` (OCR) to the image processor."""
    import transformers
    from transformers import GenerationConfig

    prefix, image_class, video_class = MINICPMV_CLASSES[variant]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in mc.SPECIAL_TOKENS}
    eos_ids = [ids[t] for t in MINICPMV4_6.prompt.eos_tokens]
    text = dict(shape["text"])
    mrope_section = text.pop("mrope_section")
    downsample = {"downsample_mode": shape["downsample_mode"]} if "downsample_mode" in shape else {}
    extra: dict[str, Any] = dict(image_size=shape["scale_resolution"], tie_word_embeddings=False)
    if variant == "minicpmv4_7":
        (newline,) = tokenizer.encode("\n", add_special_tokens=False)
        extra.update(image_start_id=ids[IMAGE_START], image_end_id=ids[IMAGE_END],
                     slice_start_id=ids[SLICE_START], slice_end_id=ids[SLICE_END], newline_id=newline)
    elif variant == "minicpm_ocr":
        extra = dict(tie_word_embeddings=True)
    config = getattr(transformers, f"{prefix}Config")(
        text_config=dict(
            vocab_size=shape["model_vocab_size"], max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0, mrope_section=mrope_section,
                                 mrope_interleaved=True, partial_rotary_factor=0.25),
            eos_token_id=eos_ids, pad_token_id=ids[mc.ENDOFTEXT], tie_word_embeddings=extra["tie_word_embeddings"],
            **text),
        vision_config=dict(shape["vision"]), insert_layer_id=shape["insert_layer_id"],
        image_token_id=ids[mc.IMAGE_TOKEN], video_token_id=ids[mc.VIDEO_TOKEN], **downsample, **extra,
    )
    model = random_model(getattr(transformers, f"{prefix}ForConditionalGeneration"), config, shape, seed)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=ids[mc.ENDOFTEXT], do_sample=False)
    model.save_pretrained(out)

    patch = shape["vision"]["patch_size"]
    common = dict(scale_resolution=shape["scale_resolution"], max_slice_nums=shape["max_slice_nums"], patch_size=patch,
                  **downsample)
    upsize = {"small_image_upsize": shape["small_image_upsize"]} if "small_image_upsize" in shape else {}
    processor = getattr(transformers, f"{prefix}Processor")(
        image_processor=getattr(transformers, image_class)(**common, **upsize),
        video_processor=getattr(transformers, video_class)(**common), tokenizer=tokenizer,
        chat_template=MINICPMV_TEMPLATE)
    processor.save_pretrained(out)


DEMOS = {"minicpmv4_6": Demo(MINICPMV4_6_SIZES, partial(_write_minicpmv, variant="minicpmv4_6")),
         "minicpmv4_7": Demo(MINICPMV4_6_SIZES, partial(_write_minicpmv, variant="minicpmv4_7")),
         "minicpm_ocr": Demo(MINICPM_OCR_SIZES, partial(_write_minicpmv, variant="minicpm_ocr"))}
