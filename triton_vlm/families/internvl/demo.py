"""The InternVL demo checkpoints: their sizes (the text model, InternViT-300M's or 6B's switches),
a reduced chat template (InternVL's `<|im_start|>` turns, `<IMG_CONTEXT>\\n` per image, `<video>\\n`
per video) and the random-weight writer."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from triton_vlm.families.demo import Demo, chat_template, perturb, random_model
from triton_vlm.families.internvl import INTERNVL
from triton_vlm.families.internvl import processor as ivl

TEMPLATE = chat_template(
    prefix="", message_start="<|im_start|>{{ message['role'] }}\n", message_end="<|im_end|>\n",
    image=ivl.IMAGE_TOKEN + "\n", video=ivl.VIDEO_TOKEN + "\n", generation_prompt="<|im_start|>assistant\n")

# InternViT-300M's switches (InternVL3's towers); the 6B's: no qkv bias, RMSNorm, q/k norms.
VIT_300M = dict(attention_bias=True, norm_type="layer_norm", use_qk_norm=False, use_mean_pooling=True)
VIT_6B = dict(attention_bias=False, norm_type="rms_norm", use_qk_norm=True, use_mean_pooling=False)

# `text_model`: qwen2 (InternVL3) or qwen3 (InternVL3.5); tiles of `image_size` pixels, at most
# `max_patches` of them.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024, text_model="qwen2", max_patches=6,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=56, patch_size=14, **VIT_300M),
    ),
    "small": dict(
        vocab_size=8192, text_model="qwen2", max_patches=12,
        text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2),
        vision=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4,
                    image_size=448, patch_size=14, **VIT_300M),
    ),
}


def _write(out: Path, shape: dict[str, Any], tokenizer, seed: int) -> None:
    """Write a random-weight InternVL checkpoint (`InternVLForConditionalGeneration`,
    `InternVLProcessor` with its GotOcr2 image and InternVL video processors, saved as
    transformers' conversion script saves them: `crop_to_patches` false, ImageNet mean and std)."""
    from transformers import (GenerationConfig, GotOcr2ImageProcessor, InternVLConfig,
                              InternVLForConditionalGeneration, InternVLProcessor, InternVLVideoProcessor)

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in INTERNVL.prompt.special_tokens}
    vision = dict(model_type="internvl_vision", **shape["vision"])
    side, patch = vision["image_size"], vision["patch_size"]
    text = dict(model_type=shape["text_model"], vocab_size=shape["model_vocab_size"], max_position_embeddings=4096,
                rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
                bos_token_id=ids[ivl.IM_START], eos_token_id=ids[ivl.EOS], pad_token_id=ids[ivl.PAD],
                tie_word_embeddings=False, **shape["text"])
    if shape["text_model"] == "qwen3":
        text["head_dim"] = shape["text"]["hidden_size"] // shape["text"]["num_attention_heads"]
    config = InternVLConfig(text_config=text, vision_config=vision, image_token_id=ids[ivl.IMAGE_TOKEN],
                            image_seq_length=(side // patch // 2) ** 2, tie_word_embeddings=False)
    model = random_model(InternVLForConditionalGeneration, config, shape, seed)
    # biases, norms, layer scales, the class token and positions start constant: move them
    perturb(model, seed, lambda name, p: 0.1 if ("vision_tower" in name or "multi_modal_projector" in name)
            and (p.ndim == 1 or "_token" in name or "position" in name) else 0)
    model.generation_config = GenerationConfig(eos_token_id=ids[ivl.EOS], pad_token_id=ids[ivl.PAD], do_sample=False)
    model.save_pretrained(out)

    size = {"height": side, "width": side}
    imagenet = dict(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    processor = InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=False, min_patches=1,
                                              max_patches=shape["max_patches"], **imagenet),
        video_processor=InternVLVideoProcessor(size=size, **imagenet), tokenizer=tokenizer,
        image_seq_length=(side // patch // 2) ** 2, chat_template=TEMPLATE)
    processor.save_pretrained(out)


DEMOS = {"internvl": Demo(SIZES, _write)}
