"""`triton-vlm demo-checkpoint`: random-weight checkpoints that transformers loads offline.

The tokenizer is a byte-level BPE trained here on generated text, with the family's special
tokens as single ids, so no model hub is needed for tests or the demo. Everything here is demo
data (`DEMOS`: each family's sizes, checkpoint writer and chat template), kept out of the serving
path: a served checkpoint brings its own.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping

from triton_vlm.families import get_family
from triton_vlm.families import glm4v as glm
from triton_vlm.families import llava
from triton_vlm.families import llava_onevision as ov
from triton_vlm.families import minicpmv as mc
from triton_vlm.families import minicpmv4_5 as mc45
from triton_vlm.families import qwen2_5_vl as qwen
from triton_vlm.families.base import Family

_WORDS = (
    "the a an image video picture frame scene shows describe what is in this of and to with on at "
    "red green blue yellow black white cat dog person car tree house sky road water light dark left "
    "right top bottom small large two three many one moving still second first next answer question "
    "color shape number count where who how why when please tell me about it there are see you can "
    "0 1 2 3 4 5 6 7 8 9 , . ? ! : ; ( ) - ' \" \n"
).split(" ")


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24))) for _ in range(n_lines)]


def train_tokenizer(family: Family, vocab_size: int, seed: int = 0):
    """A byte-level BPE with the family's special tokens, wrapped as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(family.special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=family.eos_tokens[0], pad_token=family.special_tokens[0],
        extra_special_tokens=dict(family.named_special_tokens))
    for token in family.special_tokens:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise RuntimeError(f"special token {token} encodes to {ids}, not one id")
    return tokenizer


def random_model(model_class, config, shape: dict[str, Any], seed: int):
    """`model_class(config)` with random weights from `seed`, made on the shape's `device` in its
    `dtype` (a 7B-sized model initialises in seconds on a GPU, in half the memory in bfloat16)."""
    import torch

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, shape["dtype"]))
    try:
        with torch.device(shape["device"]):
            return model_class(config).eval()
    finally:
        torch.set_default_dtype(default)


def chat_template(*, prefix: str, message_start: str, message_end: str, image: str, video: str,
                  generation_prompt: str) -> str:
    """A Jinja chat template reduced to what the demo needs: text, image and video content parts.
    `message_start` may use `{{ message['role'] }}`."""
    return (
        prefix + "{% for message in messages %}" + message_start
        + "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}" + image
        + "{% elif part['type'] == 'video' %}" + video
        + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}" + message_end + "{% endfor %}"
        "{% if add_generation_prompt %}" + generation_prompt + "{% endif %}"
    )


# The families' chat templates, reduced to what the demo needs.
QWEN_TEMPLATE = chat_template(
    prefix="", message_start="<|im_start|>{{ message['role'] }}\n", message_end="<|im_end|>\n",
    image=qwen.VISION_START + qwen.IMAGE_PAD + qwen.VISION_END, video=qwen.VISION_START + qwen.VIDEO_PAD + qwen.VISION_END,
    generation_prompt="<|im_start|>assistant\n")
GLM_TEMPLATE = chat_template(
    prefix="[gMASK]<sop>", message_start="<|{{ message['role'] }}|>\n", message_end="",
    image=glm.BEGIN_IMAGE + glm.IMAGE_TOKEN + glm.END_IMAGE, video=glm.BEGIN_VIDEO + glm.VIDEO_TOKEN + glm.END_VIDEO,
    generation_prompt="<|assistant|>\n")
MINICPMV_TEMPLATE = chat_template(
    prefix="", message_start="<|im_start|>{{ message['role'] }}\n", message_end="<|im_end|>\n",
    image=mc.IMAGE_TOKEN, video=mc.VIDEO_TOKEN, generation_prompt="<|im_start|>assistant\n")

LLAVA_TEMPLATE = chat_template(
    prefix="", message_start="{{ message['role'] | upper }}: ", message_end="\n", image=llava.IMAGE_TOKEN + "\n",
    video=llava.VIDEO_TOKEN + "\n", generation_prompt="ASSISTANT:")

# LLaVA-OneVision's (Qwen2's im_start / im_end turns, media before the text).
LLAVA_ONEVISION_TEMPLATE = chat_template(
    prefix="", message_start="<|im_start|>{{ message['role'] }}\n", message_end="<|im_end|>\n",
    image=ov.IMAGE_TOKEN + "\n", video=ov.VIDEO_TOKEN + "\n", generation_prompt="<|im_start|>assistant\n")

MINICPMV4_5_TEMPLATE = chat_template(
    prefix="", message_start="<|im_start|>{{ message['role'] }}\n", message_end="<|im_end|>\n",
    image=mc45.IMAGE_PLACEHOLDER, video=mc45.VIDEO_PLACEHOLDER, generation_prompt="<|im_start|>assistant\n")


# Random-weight demo shapes. `tiny` keeps tests to seconds; `small` is tens of millions of
# parameters for the demo and benchmarks.
# Qwen2.5-VL: windows and full-attention blocks as in the real models (window 112 px, full
# attention every few blocks).
QWEN2_5_VL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, mrope_section=[2, 3, 3]),
        vision=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[1, 3]),
        image_pixels=(4 * 28 * 28, 256 * 28 * 28), video_pixels=(4 * 28 * 28, 64 * 28 * 28),
    ),
    "small": dict(
        vocab_size=8192,
        text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, mrope_section=[8, 12, 12]),
        vision=dict(depth=8, hidden_size=256, intermediate_size=704, num_heads=4, fullatt_block_indexes=[3, 7]),
        image_pixels=(16 * 28 * 28, 1024 * 28 * 28), video_pixels=(16 * 28 * 28, 256 * 28 * 28),
    ),
}

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

# MiniCPM-V 4.5: a Qwen3 decoder (its width a multiple of 128: the resampler's heads are 128 wide),
# SigLIP with a 980 px position table, `query_num` rows per slice.
MINICPMV4_5_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024,
        text=dict(hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
        vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    image_size=980, patch_size=14),
        query_num=8, scale_resolution=112, max_slice_nums=4,
    ),
    "small": dict(
        vocab_size=8192,
        text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64),
        vision=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4,
                    image_size=980, patch_size=14),
        query_num=64, scale_resolution=448, max_slice_nums=9,
    ),
}

# LLaVA: the tower (`vision_model`: clip_vision_model or siglip_vision_model) sees image_size
# squares (CLIPImageProcessor: shortest edge, then the centre crop, both image_size); `small` has
# LLaVA-1.5's 24 x 24 patches. `text_model` (llama, qwen2), `vision_feature_layer` and
# `vision_feature_select_strategy` are the variants the tests cover, and `image_processor` ("clip",
# the default: shortest edge and centre crop; "siglip": resized to the square, no crop).
LLAVA_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024, text_model="llama", vision_model="clip_vision_model",
        vision_feature_layer=-2, vision_feature_select_strategy="default",
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                    image_size=112, patch_size=14),
    ),
    "small": dict(
        vocab_size=8192, text_model="llama", vision_model="clip_vision_model",
        vision_feature_layer=-2, vision_feature_select_strategy="default",
        text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2),
        vision=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4,
                    image_size=336, patch_size=14),
    ),
}

# LLaVA-OneVision: tiles of `image_size` pixels (S = image_size / patch_size features a side, odd
# here so that the video pooling rounds up), pinpoints up to 3 x 3 tiles, and "anyres_max_4" in the
# tiny shape so that large images take the bilinear cut.
def grid_pinpoints(tile: int, most: int) -> list[list[int]]:
    return [[tile * r, tile * c] for r in range(1, most + 1) for c in range(1, most + 1)]


LLAVA_ONEVISION_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024, vision_aspect_ratio="anyres_max_4", pinpoints=grid_pinpoints(70, 3),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                    image_size=70, patch_size=14),
    ),
    "small": dict(
        vocab_size=8192, vision_aspect_ratio="anyres_max_9", pinpoints=grid_pinpoints(384, 6),
        text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2),
        vision=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4,
                    image_size=384, patch_size=14),
    ),
}

# GLM: rotary covers half of each head (`partial_rotary_factor` 0.5), so `mrope_section` sums to
# head_dim / 4. `image_size` sets the learned position-embedding grid that the GLM-4.1V tower
# interpolates to every image's patch grid (GLM-OCR's tower has none).
GLM_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, mrope_section=[2, 3, 3]),
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, image_size=112),
        image_pixels=(112 * 112, 256 * 28 * 28), video_pixels=(112 * 112, 2 * 64 * 28 * 28),
    ),
    "small": dict(
        vocab_size=8192,
        text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, mrope_section=[4, 6, 6]),
        vision=dict(depth=8, hidden_size=256, intermediate_size=704, num_heads=4, image_size=336),
        image_pixels=(112 * 112, 1024 * 28 * 28), video_pixels=(112 * 112, 2 * 256 * 28 * 28),
    ),
}

# GLM-4.5V: GLM_SIZES with a mixture-of-experts text stack: dense layers before
# `first_k_dense_replace`, then routed experts in `n_group` groups (more experts than
# `num_experts_per_tok`, more than one group, so the group-limited choice is exercised) plus shared ones.
GLM4V_MOE_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {**GLM_SIZES["tiny"], "text": {
        **GLM_SIZES["tiny"]["text"], "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "routed_scaling_factor": 2.5, "norm_topk_prob": True}},
    "small": {**GLM_SIZES["small"], "text": {
        **GLM_SIZES["small"]["text"], "first_k_dense_replace": 1, "n_routed_experts": 16,
        "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 256, "routed_scaling_factor": 2.5, "norm_topk_prob": True}},
}


def _write_qwen2_5_vl(out: Path, shape: dict[str, Any], tokenizer, seed: int) -> None:
    """Write a random-weight Qwen2.5-VL checkpoint that transformers loads offline."""
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in qwen.QWEN2_5_VL.special_tokens}
    eos_ids = [ids[t] for t in qwen.QWEN2_5_VL.eos_tokens]
    text = dict(shape["text"])
    mrope_section = text.pop("mrope_section")
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=shape["model_vocab_size"], max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=mrope_section),
            bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids, pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=False, **text),
        vision_config=dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           tokens_per_second=2, out_hidden_size=text["hidden_size"], in_channels=3,
                           **shape["vision"]),
        image_token_id=ids[qwen.IMAGE_PAD], video_token_id=ids[qwen.VIDEO_PAD],
        vision_start_token_id=ids[qwen.VISION_START], vision_end_token_id=ids[qwen.VISION_END],
        tie_word_embeddings=False,
    )
    model = random_model(Qwen2_5_VLForConditionalGeneration, config, shape, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids, pad_token_id=ids["<|endoftext|>"],
        do_sample=False)
    model.save_pretrained(out)

    (img_min, img_max), (vid_min, vid_max) = shape["image_pixels"], shape["video_pixels"]
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=img_min, max_pixels=img_max),
        video_processor=Qwen2VLVideoProcessor(min_pixels=vid_min, max_pixels=vid_max, fps=2.0),
        tokenizer=tokenizer, chat_template=QWEN_TEMPLATE)
    processor.save_pretrained(out)


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
    eos_ids = [ids[t] for t in mc.MINICPMV4_6.eos_tokens]
    text = dict(shape["text"])
    mrope_section = text.pop("mrope_section")
    downsample = {"downsample_mode": shape["downsample_mode"]} if "downsample_mode" in shape else {}
    extra: dict[str, Any] = dict(image_size=shape["scale_resolution"], tie_word_embeddings=False)
    if variant == "minicpmv4_7":
        (newline,) = tokenizer.encode("\n", add_special_tokens=False)
        extra.update(image_start_id=ids[mc.IMAGE_START], image_end_id=ids[mc.IMAGE_END],
                     slice_start_id=ids[mc.SLICE_START], slice_end_id=ids[mc.SLICE_END], newline_id=newline)
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


def _write_llava(out: Path, shape: dict[str, Any], tokenizer, seed: int) -> None:
    """Write a random-weight LLaVA checkpoint (`LlavaForConditionalGeneration`, `LlavaProcessor`
    with a `CLIPImageProcessor`) that transformers loads offline."""
    from transformers import (CLIPImageProcessor, GenerationConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor, SiglipImageProcessor)

    from triton_vlm.vision.llava import TOWER_KINDS

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in llava.LLAVA.special_tokens}
    vision = dict(model_type=shape["vision_model"], **shape["vision"])
    config = LlavaConfig(
        text_config=dict(
            model_type=shape["text_model"], vocab_size=shape["model_vocab_size"], max_position_embeddings=4096,
            rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            bos_token_id=ids[llava.BOS], eos_token_id=ids[llava.EOS], pad_token_id=ids[llava.PAD],
            tie_word_embeddings=False, **shape["text"]),
        vision_config=vision, image_token_id=ids[llava.IMAGE_TOKEN],
        vision_feature_layer=shape["vision_feature_layer"],
        vision_feature_select_strategy=shape["vision_feature_select_strategy"], tie_word_embeddings=False,
    )
    model = random_model(LlavaForConditionalGeneration, config, shape, seed)
    model.generation_config = GenerationConfig(bos_token_id=ids[llava.BOS], eos_token_id=ids[llava.EOS],
                                               pad_token_id=ids[llava.PAD], do_sample=False)
    model.save_pretrained(out)

    side = vision["image_size"]
    image_processors = {  # LLaVA-1.5's; llava-interleave's (SigLIP tower)
        "clip": lambda: CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}),
        "siglip": lambda: SiglipImageProcessor(size={"height": side, "width": side})}
    processor = LlavaProcessor(
        image_processor=image_processors[shape.get("image_processor", "clip")](), tokenizer=tokenizer, patch_size=vision["patch_size"],
        vision_feature_select_strategy=shape["vision_feature_select_strategy"],
        num_additional_image_tokens=int(TOWER_KINDS[shape["vision_model"]].class_token), chat_template=LLAVA_TEMPLATE)
    processor.save_pretrained(out)


def _write_llava_onevision(out: Path, shape: dict[str, Any], tokenizer, seed: int) -> None:
    """Write a random-weight LLaVA-OneVision checkpoint (`LlavaOnevisionForConditionalGeneration`,
    `LlavaOnevisionProcessor` with its image and video processors) that transformers loads offline:
    SigLIP tower, the last layer's features ("full"), Qwen2 decoder."""
    import torch
    from transformers import (GenerationConfig, LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                              LlavaOnevisionImageProcessor, LlavaOnevisionProcessor,
                              LlavaOnevisionVideoProcessor)

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ov.LLAVA_ONEVISION.special_tokens}
    vision = dict(model_type="siglip_vision_model", **shape["vision"])
    config = LlavaOnevisionConfig(
        text_config=dict(
            model_type="qwen2", vocab_size=shape["model_vocab_size"], max_position_embeddings=4096,
            rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            bos_token_id=ids[ov.IM_START], eos_token_id=ids[ov.EOS], pad_token_id=ids[ov.PAD],
            tie_word_embeddings=False, **shape["text"]),
        vision_config=vision, image_token_id=ids[ov.IMAGE_TOKEN], video_token_id=ids[ov.VIDEO_TOKEN],
        vision_feature_layer=-1, vision_feature_select_strategy="full", image_grid_pinpoints=shape["pinpoints"],
        vision_aspect_ratio=shape["vision_aspect_ratio"], tie_word_embeddings=False,
    )
    model = random_model(LlavaOnevisionForConditionalGeneration, config, shape, seed)
    with torch.no_grad():  # SigLIP's biases start at zero and its norms at one: move them
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("vision_tower" in name or "multi_modal_projector" in name):
                p.add_(torch.randn(p.shape, generator=gen).to(p) * 0.1)
    model.generation_config = GenerationConfig(eos_token_id=ids[ov.EOS], pad_token_id=ids[ov.PAD], do_sample=False)
    model.save_pretrained(out)

    side, patch = vision["image_size"], vision["patch_size"]
    size = {"height": side, "width": side}
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=shape["pinpoints"]),
        video_processor=LlavaOnevisionVideoProcessor(size=size), tokenizer=tokenizer,
        num_image_tokens=(side // patch) ** 2, vision_feature_select_strategy="full",
        vision_aspect_ratio=shape["vision_aspect_ratio"], chat_template=LLAVA_ONEVISION_TEMPLATE)
    processor.save_pretrained(out)


def _write_minicpmv4_5(out: Path, shape: dict[str, Any], tokenizer, seed: int) -> None:
    """A random-weight MiniCPM-V 4.5 checkpoint as the official remote code reads it (transformers
    has no class for it): the decoder's weights made by transformers' Qwen3 under `llm.`, the
    tower's by ours (`vpm.`, `resampler.`), the official config and processor fields."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from triton_vlm.vision.minicpmv4_5 import MiniCPMV4_5VisionTower, vision_settings

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in mc45.SPECIAL_TOKENS}
    patch = shape["vision"]["patch_size"]
    text = dict(vocab_size=shape["model_vocab_size"], max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_theta=1000000.0, hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
                bos_token_id=ids[mc45.IM_START], eos_token_id=ids[mc45.IM_END], **shape["text"])
    config = dict(version=4.5, architectures=["MiniCPMV"], model_type="minicpmv", **text,
                  vision_config=dict(model_type="siglip", **shape["vision"]), query_num=shape["query_num"],
                  image_size=shape["scale_resolution"], patch_size=patch, slice_mode=True, batch_vision_input=True,
                  batch_3d_resampler=True, drop_vision_last_layer=False)
    llm = random_model(Qwen3ForCausalLM, Qwen3Config(**text), shape, seed)
    tower = random_model(MiniCPMV4_5VisionTower, vision_settings(config), shape, seed + 1)
    with torch.no_grad():  # (the module starts them at zero: the checkpoint sets them)
        tower.resampler.query.normal_(std=0.02)
        tower.resampler.proj.normal_(std=tower.resampler.proj.shape[0] ** -0.5)
    weights = {f"llm.{name}": value for name, value in llm.state_dict().items()} | tower.state_dict()
    save_file({name: value.contiguous() for name, value in weights.items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    processor = dict(image_processor_type="MiniCPMVImageProcessor", processor_class="MiniCPMVProcessor",
                     max_slice_nums=shape["max_slice_nums"], scale_resolution=shape["scale_resolution"],
                     patch_size=patch, use_image_id=True, image_feature_size=shape["query_num"], slice_mode=True,
                     norm_mean=[0.5] * 3, norm_std=[0.5] * 3, **{key: token for key, token in mc45.NAMED_TOKENS.items()
                                                                  if key != "unk_token"}, unk=mc45.UNK)
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    tokenizer.chat_template = MINICPMV4_5_TEMPLATE
    tokenizer.save_pretrained(out)


@dataclass(frozen=True)
class GlmClasses:
    """What one GLM checkpoint is made of: its transformers class names, and whether it carries a
    multi-token-prediction layer after its decoder layers (served checkpoints do; it is not loaded)."""
    config: str
    model: str
    processor: str
    image_processor: str
    video_processor: str
    mtp_layer: bool = False


GLM_CLASSES: dict[str, GlmClasses] = {
    "glm4v": GlmClasses("Glm4vConfig", "Glm4vForConditionalGeneration", "Glm4vProcessor",
                        "Glm4vImageProcessor", "Glm4vVideoProcessor"),
    "glm46v": GlmClasses("Glm46VConfig", "Glm46VForConditionalGeneration", "Glm46VProcessor",
                         "Glm46VImageProcessor", "Glm46VVideoProcessor"),
    "glmga": GlmClasses("GlmgaConfig", "Glm46VForConditionalGeneration", "Glm46VProcessor",
                        "GlmgaImageProcessor", "GlmgaVideoProcessor"),
    "glm_ocr": GlmClasses("GlmOcrConfig", "GlmOcrForConditionalGeneration", "Glm46VProcessor",
                          "Glm46VImageProcessor", "Glm46VVideoProcessor", mtp_layer=True),
    "glm4v_moe": GlmClasses("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration", "Glm4vProcessor",
                            "Glm4vImageProcessor", "Glm4vVideoProcessor", mtp_layer=True),
}


def _write_glm(out: Path, shape: dict[str, Any], tokenizer, seed: int, *, variant: str) -> None:
    """A random-weight GLM checkpoint of `variant` (`GLM_CLASSES`) that transformers loads offline."""
    import torch
    import transformers
    from transformers import GenerationConfig

    names = GLM_CLASSES[variant]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in glm.SPECIAL_TOKENS}
    eos_ids = [ids[t] for t in glm.EOS_TOKENS]
    text = dict(shape["text"])
    mrope_section = text.pop("mrope_section")
    config = getattr(transformers, names.config)(
        text_config=dict(
            vocab_size=shape["model_vocab_size"], max_position_embeddings=4096, rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=mrope_section,
                                 partial_rotary_factor=0.5),
            eos_token_id=eos_ids, pad_token_id=ids[glm.ENDOFTEXT], **text),
        vision_config=dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           out_hidden_size=text["hidden_size"], rms_norm_eps=1e-5, **shape["vision"]),
        image_token_id=ids[glm.IMAGE_TOKEN], video_token_id=ids[glm.VIDEO_TOKEN],
        image_start_token_id=ids[glm.BEGIN_IMAGE], image_end_token_id=ids[glm.END_IMAGE],
        video_start_token_id=ids[glm.BEGIN_VIDEO], video_end_token_id=ids[glm.END_VIDEO],
        tie_word_embeddings=False,
    )
    model = random_model(getattr(transformers, names.model), config, shape, seed)
    # transformers initialises the routers' score-correction bias to zero, which would leave the
    # biased expert choice untested: a random one, of the sigmoid scores' scale.
    generator = torch.Generator().manual_seed(seed + 1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.rand(buffer.shape, generator=generator) * 0.5)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=ids[glm.ENDOFTEXT],
                                               do_sample=False)
    model.save_pretrained(out)
    if names.mtp_layer:
        _add_mtp_layer(out, config.text_config.num_hidden_layers, seed)

    (img_min, img_max), (vid_min, vid_max) = shape["image_pixels"], shape["video_pixels"]
    image_processor = getattr(transformers, names.image_processor)(
        size={"shortest_edge": img_min, "longest_edge": img_max})
    video_processor = getattr(transformers, names.video_processor)(
        size={"shortest_edge": vid_min, "longest_edge": vid_max})
    processor = getattr(transformers, names.processor)(
        image_processor=image_processor, video_processor=video_processor, tokenizer=tokenizer,
        chat_template=GLM_TEMPLATE)
    processor.save_pretrained(out)


def _add_mtp_layer(out: Path, num_layers: int, seed: int) -> None:
    """Append a multi-token-prediction layer `layers.{num_layers}.*` to the checkpoint (a decoder
    layer's tensors plus the MTP head's `eh_proj`, `enorm`, `hnorm`, `shared_head.norm`, all random),
    as released GLM-OCR / GLM-4.5V weights hold one that transformers and our decoder do not load."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed + 2)
    last, mtp = f"model.language_model.layers.{num_layers - 1}.", f"model.language_model.layers.{num_layers}."
    extra = {mtp + key[len(last):]: torch.randn(value.shape, generator=generator)
             for key, value in tensors.items() if key.startswith(last)}
    hidden = tensors["model.language_model.norm.weight"].shape[0]
    extra[mtp + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        extra[mtp + f"{norm}.weight"] = torch.randn(hidden, generator=generator)
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})


@dataclass(frozen=True)
class Demo:
    """A family's demo checkpoint: its sizes and its writer (`write(out, shape, tokenizer, seed)`,
    `shape` from `demo_shape`)."""
    sizes: dict[str, dict[str, Any]]
    write: Callable[..., None]


def _glm(variant: str, sizes: dict[str, dict[str, Any]] = GLM_SIZES) -> Demo:
    return Demo(sizes, partial(_write_glm, variant=variant))


DEMOS: dict[str, Demo] = {
    "qwen2_5_vl": Demo(QWEN2_5_VL_SIZES, _write_qwen2_5_vl),
    "glm4v": _glm("glm4v"), "glm46v": _glm("glm46v"), "glmga": _glm("glmga"), "glm_ocr": _glm("glm_ocr"),
    "glm4v_moe": _glm("glm4v_moe", GLM4V_MOE_SIZES),
    "minicpmv4_6": Demo(MINICPMV4_6_SIZES, partial(_write_minicpmv, variant="minicpmv4_6")),
    "minicpmv4_7": Demo(MINICPMV4_6_SIZES, partial(_write_minicpmv, variant="minicpmv4_7")),
    "minicpm_ocr": Demo(MINICPM_OCR_SIZES, partial(_write_minicpmv, variant="minicpm_ocr")),
    "minicpmv4_5": Demo(MINICPMV4_5_SIZES, _write_minicpmv4_5),
    "llava": Demo(LLAVA_SIZES, _write_llava),
    "llava_onevision": Demo(LLAVA_ONEVISION_SIZES, _write_llava_onevision),
}


def demo_shape(family: Family, size: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The family's `size` shape with `overrides` on top (`text` and `vision` replaced key by key).
    Besides the family's keys, a shape holds `dtype` (of the written weights, default float32),
    `device` (where the random weights are made, default CPU) and may hold `model_vocab_size` (the
    model's vocabulary rows, past the tokenizer's, as real Qwen checkpoints pad theirs)."""
    sizes = DEMOS[family.name].sizes
    if size not in sizes:
        raise ValueError(f"size must be one of {sorted(sizes)}")
    shape: dict[str, Any] = {"dtype": "float32", "device": "cpu", **sizes[size]}
    for key, value in (overrides or {}).items():
        shape[key] = {**shape[key], **value} if isinstance(value, Mapping) and key in shape else value
    return shape


def write_demo_checkpoint(family_name: str, out: str | Path, size: str = "tiny", seed: int = 0,
                          overrides: Mapping[str, Any] | None = None) -> Path:
    """A random-weight checkpoint of `family_name` at `size` (with `overrides`, see `demo_shape`)."""
    family = get_family(family_name)
    shape = demo_shape(family, size, overrides)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(family, shape["vocab_size"], seed)
    shape.setdefault("model_vocab_size", len(tokenizer))
    DEMOS[family.name].write(out, shape, tokenizer, seed)
    return out
