"""The Gemma 3 demo checkpoints: their sizes, a reduced chat template and the random-weight writer
(`Gemma3ForConditionalGeneration`, `Gemma3Processor` with a `Gemma3ImageProcessor`, a tokenizer that
adds `<bos>` as Gemma's does)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from triton_vlm.families.demo import Demo, chat_template, perturb, random_model
from triton_vlm.families.gemma3 import GEMMA3
from triton_vlm.families.gemma3 import processor as gemma3

TEMPLATE = chat_template(
    prefix="", message_start=gemma3.START_OF_TURN + "{{ message['role'] }}\n", message_end=gemma3.END_OF_TURN + "\n",
    image=gemma3.BOI, video="", generation_prompt=gemma3.START_OF_TURN + "model\n")

# The tiny shape's sliding window (12 tokens) is shorter than its image runs (16 tokens) and its
# prompts, so the window, and the image blocks that reach past it, are exercised.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024, mm_tokens_per_image=16,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
                  rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
                                   "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=112, patch_size=14),
    ),
    "small": dict(
        vocab_size=8192, mm_tokens_per_image=64,
        text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=12, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, query_pre_attn_scalar=64, sliding_window=512,
                  rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
                                   "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
        vision=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4,
                    image_size=448, patch_size=14),
    ),
}


def add_bos(tokenizer) -> None:
    """Gemma's tokenizer puts `<bos>` before every encoded text (its post-processor)."""
    from tokenizers.processors import TemplateProcessing

    bos = tokenizer.convert_tokens_to_ids(gemma3.BOS)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{gemma3.BOS} $A", pair=f"{gemma3.BOS} $A {gemma3.BOS} $B", special_tokens=[(gemma3.BOS, bos)])
    tokenizer.bos_token = gemma3.BOS


def _write(out: Path, shape: dict[str, Any], tokenizer, seed: int) -> None:
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor,
                              GenerationConfig)

    add_bos(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA3.prompt.special_tokens}
    eos = [ids[gemma3.EOS], ids[gemma3.END_OF_TURN]]
    vision = dict(model_type="siglip_vision_model", **shape["vision"])
    config = Gemma3Config(
        text_config=dict(model_type="gemma3_text", vocab_size=shape["model_vocab_size"], max_position_embeddings=4096,
                         bos_token_id=ids[gemma3.BOS], eos_token_id=eos, pad_token_id=ids[gemma3.PAD],
                         **shape["text"]),
        vision_config=vision, mm_tokens_per_image=shape["mm_tokens_per_image"], boi_token_index=ids[gemma3.BOI],
        eoi_token_index=ids[gemma3.EOI], image_token_index=ids[gemma3.IMAGE_TOKEN],
        bos_token_id=ids[gemma3.BOS], eos_token_id=eos, pad_token_id=ids[gemma3.PAD])
    model = random_model(Gemma3ForConditionalGeneration, config, shape, seed)
    # biases start at zero and (1 + w) norms at w = 0, the projection at zero: move them
    perturb(model, seed, lambda name, p: 0.1 if p.ndim == 1 else 0.2 if "mm_input_projection" in name else 0)
    model.generation_config = GenerationConfig(bos_token_id=ids[gemma3.BOS], eos_token_id=eos,
                                               pad_token_id=ids[gemma3.PAD], do_sample=False)
    model.save_pretrained(out)

    side = vision["image_size"]
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": side, "width": side}), tokenizer=tokenizer,
        image_seq_length=shape["mm_tokens_per_image"], chat_template=TEMPLATE)
    processor.save_pretrained(out)


DEMOS = {"gemma3": Demo(SIZES, _write)}
