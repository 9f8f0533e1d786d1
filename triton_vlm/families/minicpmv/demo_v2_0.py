"""MiniCPM-V 2.0's demo checkpoint, in the official layout: the official `config.json` fields (the
image processing's settings, MiniCPM's scalings, the timm tower's name and no `version`), a
SentencePiece `tokenizer.model` trained here as 2.0's is made (BPE, byte fallback, digits split,
`\\n` and the image and chat markers user-defined symbols) with the official `tokenizer_config.json`,
the decoder's weights made by transformers' Llama (MiniCPM's parameters have its names and shapes)
under `llm.`, the tower's by ours (`vpm.`, `resampler.`; the so400m's 72-wide heads).
"""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from triton_vlm.families.demo import Demo, corpus, random_model
from triton_vlm.families.minicpmv import MINICPMV2_0

# The tiny one is the golden checkpoint's shape (`tests/golden/minicpmv2_0`).
_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=600, text=dict(hidden_size=256, intermediate_size=160, num_hidden_layers=3,
                                           num_attention_heads=4, num_key_value_heads=4),
                 vision=dict(hidden_size=144, intermediate_size=538, depth=2), query_num=16, scale_resolution=112,
                 max_slice_nums=4),
    "small": dict(vocab_size=4096, text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                             num_attention_heads=8, num_key_value_heads=8),
                  vision=dict(hidden_size=288, intermediate_size=1152, depth=4), query_num=64, scale_resolution=448,
                  max_slice_nums=9),
}
# The official config's fields beyond the sizes.
_OFFICIAL = dict(
    architectures=["MiniCPMV"], model_type="minicpmv", attention_bias=False, attention_dropout=0.0,
    auto_map={"AutoConfig": "configuration_minicpm.MiniCPMVConfig", "AutoModel": "modeling_minicpmv.MiniCPMV",
              "AutoModelForCausalLM": "modeling_minicpmv.MiniCPMV"},
    bos_token_id=1, eos_token_id=2, dim_model_base=256, scale_emb=12, scale_depth=1.4, drop_vision_last_layer=True,
    hidden_act="silu", image_size=448, initializer_range=0.1, max_position_embeddings=4096, mm_use_im_start_end=True,
    patch_size=14, pretraining_tp=1, rms_norm_eps=1e-5, rope_scaling=None, rope_theta=10000.0, slice_mode=True,
    tie_word_embeddings=False, use_cache=True, vision_encoder="vit_so400m_patch14_siglip_384.webli")


def train_sentencepiece(out: Path, vocab_size: int, seed: int) -> tuple[dict[str, int], int]:
    """`tokenizer.model` (ids 0-2 `<unk>`, `<s>`, `</s>`, then the user-defined symbols; at most
    `vocab_size` pieces), the ids of the family's special tokens and the number of pieces."""
    import sentencepiece

    symbols = ["\n", *MINICPMV2_0.prompt.special_tokens[3:]]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(4000, seed)), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        user_defined_symbols=symbols, byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        add_dummy_prefix=True, remove_extra_whitespaces=False, hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, minloglevel=2)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    return {token: processor.piece_to_id(token) for token in MINICPMV2_0.prompt.special_tokens}, len(processor)


def _tokenizer_files(out: Path, ids: dict[str, int]) -> None:
    """The official `tokenizer_config.json` (its added tokens: `<unk>`, `<s>`, `</s>` and the
    markers, at this model's ids) and `special_tokens_map.json`."""
    special = [t for t in MINICPMV2_0.prompt.special_tokens if t not in ("<用户>", "<AI>")]
    added = {str(ids[t]): dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
             for t in special}
    markers = special[3:]
    config = dict(add_bos_token=True, add_eos_token=False, added_tokens_decoder=added,
                  additional_special_tokens=markers, auto_map={"AutoTokenizer": ["modeling_minicpmv.LlamaTokenizerWrapper",
                                                                                 None]},
                  bos_token="<s>", clean_up_tokenization_spaces=False, eos_token="</s>", legacy=True, pad_token="<unk>",
                  sp_model_kwargs={}, spaces_between_special_tokens=False, tokenizer_class="LlamaTokenizerWrapper",
                  unk_token="<unk>", use_default_system_prompt=False)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(json.dumps(dict(
        additional_special_tokens=markers, bos_token="<s>", eos_token="</s>", pad_token="<unk>", unk_token="<unk>"),
        indent=2))


def write(out: Path, shape: dict[str, Any], tokenizer: Any, seed: int) -> None:
    """A random-weight 2.0 checkpoint (`tokenizer`, the byte-level BPE every demo is given, is not
    2.0's kind: a SentencePiece model is trained instead)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from triton_vlm.families.minicpmv.tower_v2_0 import HEAD_DIM, MiniCPMV2_0VisionTower, vision_settings
    from triton_vlm.vision.tower import config as tower_config

    ids, pieces = train_sentencepiece(out, shape["vocab_size"], seed)
    _tokenizer_files(out, ids)
    vocab_size = max(pieces, shape["model_vocab_size"])  # (that of `tokenizer`, unless the shape sets more)
    config = dict(_OFFICIAL, **shape["text"], vocab_size=vocab_size, query_num=shape["query_num"], torch_dtype=shape["dtype"],
                  scale_resolution=shape["scale_resolution"], max_slice_nums=shape["max_slice_nums"])
    llm_config = transformers.LlamaConfig(**{k: config[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "rms_norm_eps", "rope_theta", "tie_word_embeddings")})
    llm = random_model(transformers.LlamaForCausalLM, llm_config, shape, seed)
    vision = shape["vision"]
    settings = tower_config.add_derived(dict(vision_settings(config), hidden_size=vision["hidden_size"],
                                             depth=vision["depth"], num_heads=vision["hidden_size"] // HEAD_DIM,
                                             intermediate_size=vision["intermediate_size"], pos_embed_size=27))
    tower = random_model(MiniCPMV2_0VisionTower, settings, shape, seed + 1)
    with torch.no_grad():  # (the module starts them at zero: the checkpoint sets them)
        side = int(shape["query_num"] ** 0.5)  # the stored query table: the 2-D sin-cos of the query grid
        grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(-1, 2)
        tower.resampler.pos_embed.copy_(tower.resampler.key_sincos(grid))
        tower.vpm.pos_embed.normal_(std=0.02)
        tower.resampler.query.normal_(std=0.02)
        tower.resampler.proj.normal_(std=tower.resampler.proj.shape[0] ** -0.5)
    weights = {f"llm.{name}": value for name, value in llm.state_dict().items()} | tower.state_dict()
    save_file({name: value.contiguous() for name, value in weights.items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(dict(bos_token_id=1, eos_token_id=2), indent=2))


DEMOS = {"minicpmv2_0": Demo(_SIZES, write)}
