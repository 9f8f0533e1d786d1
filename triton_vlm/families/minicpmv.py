"""MiniCPM-V 4.6 (transformers `minicpmv4_6`): a SigLIP-style vision tower with per-slice sizes,
a window-attention merger and a downsampling merger, on the Qwen3.5 hybrid text stack.

Images are sliced (the overview image plus a grid of slices under `max_slice_nums`); the prompt
holds one image token per image, which the processor replaces by
`<image_id>N</image_id><image>...</image>` and `<slice>...</slice>` runs, rows joined by newlines.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from triton_vlm.families.base import Family, chat_template

IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
IMAGE_START, IMAGE_END = "<image>", "</image>"
SLICE_START, SLICE_END = "<slice>", "</slice>"
IMAGE_ID_START, IMAGE_ID_END = "<image_id>", "</image_id>"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, IMAGE_TOKEN, VIDEO_TOKEN, IMAGE_START, IMAGE_END,
                  SLICE_START, SLICE_END, IMAGE_ID_START, IMAGE_ID_END)
NAMED_TOKENS = {"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN, "image_start_token": IMAGE_START,
                "image_end_token": IMAGE_END, "slice_start_token": SLICE_START, "slice_end_token": SLICE_END,
                "image_id_start_token": IMAGE_ID_START, "image_id_end_token": IMAGE_ID_END}

CHAT_TEMPLATE = chat_template(
    prefix="", message_start="<|im_start|>{{ message['role'] }}\n", message_end="<|im_end|>\n",
    image=IMAGE_TOKEN, video=VIDEO_TOKEN, generation_prompt="<|im_start|>assistant\n")

# Random-weight demo shapes. The text stack alternates linear-attention (gated delta rule) and
# full-attention layers as Qwen3.5 does (`full_attention_interval`); the vision tower inserts its
# window-attention merger after `insert_layer_id`.
DEMO_SIZES: dict[str, dict[str, Any]] = {
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


def write_demo(out: Path, size: str, tokenizer, seed: int) -> None:
    """Write a random-weight MiniCPM-V 4.6 checkpoint that transformers loads offline."""
    import torch
    from transformers import (GenerationConfig, MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration,
                              MiniCPMV4_6ImageProcessor, MiniCPMV4_6Processor, MiniCPMV4_6VideoProcessor)

    shape = DEMO_SIZES[size]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    eos_ids = [ids[t] for t in MINICPMV4_6.eos_tokens]
    text = dict(shape["text"])
    mrope_section = text.pop("mrope_section")
    config = MiniCPMV4_6Config(
        text_config=dict(
            vocab_size=len(tokenizer), max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0, mrope_section=mrope_section,
                                 mrope_interleaved=True, partial_rotary_factor=0.25),
            eos_token_id=eos_ids, pad_token_id=ids[ENDOFTEXT], tie_word_embeddings=False, **text),
        vision_config=dict(shape["vision"]),
        insert_layer_id=shape["insert_layer_id"], image_size=shape["scale_resolution"],
        image_token_id=ids[IMAGE_TOKEN], video_token_id=ids[VIDEO_TOKEN], tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = MiniCPMV4_6ForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=ids[ENDOFTEXT], do_sample=False)
    model.save_pretrained(out)

    patch = shape["vision"]["patch_size"]
    common = dict(scale_resolution=shape["scale_resolution"], max_slice_nums=shape["max_slice_nums"], patch_size=patch)
    processor = MiniCPMV4_6Processor(
        image_processor=MiniCPMV4_6ImageProcessor(**common), video_processor=MiniCPMV4_6VideoProcessor(**common),
        tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)


def encoder_dims(config: dict) -> tuple[int, int]:
    vision = config["vision_config"]
    return vision.get("num_channels", 3) * vision["patch_size"] ** 2, config["text_config"]["hidden_size"]


MINICPMV4_6 = Family(
    name="minicpmv4_6",
    model_types=("minicpmv4_6",),
    image_placeholder=IMAGE_TOKEN,
    video_placeholder=VIDEO_TOKEN,
    special_tokens=SPECIAL_TOKENS,
    named_special_tokens=NAMED_TOKENS,
    encoder_dims=encoder_dims,
    demo_sizes=DEMO_SIZES,
    write_demo=write_demo,
    chat_template=CHAT_TEMPLATE,
    eos_tokens=(IM_END, ENDOFTEXT),
)
