"""Demo checkpoints of the MiniCPM-V versions transformers lacks (2.5, 2.6, 4.0, 4.5: the official
remote code's `MiniCPMV`), written as that code reads them: the decoder's weights made by
transformers' class for it (Llama, Qwen2, Qwen3) under `llm.`, the tower's by ours (`vpm.`,
`resampler.`), the official config's and processor config's fields, the official chat template
(4.5: a reduced one).
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from triton_vlm.families.demo import Demo, chat_template, random_model
from triton_vlm.families.minicpmv import MINICPMV2_5, MINICPMV2_6, MINICPMV4_0, MINICPMV4_5
from triton_vlm.families.minicpmv import remote_code as rc

# The official templates: 2.6's puts its default system prompt first where the messages have none.
MINICPMV2_6_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MINICPMV4_0_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MINICPMV2_5_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}")
MINICPMV4_5_TEMPLATE = chat_template(
    prefix="", message_start="<|im_start|>{{ message['role'] }}\n", message_end="<|im_end|>\n",
    image=rc.IMAGE_PLACEHOLDER, video=rc.VIDEO_PLACEHOLDER, generation_prompt="<|im_start|>assistant\n")


def _sizes(head_dims: tuple[int, int], tiny: dict[str, Any], **official: Any) -> dict[str, dict[str, Any]]:
    """A decoder whose width is a multiple of 128 (the resampler's heads are 128 wide), SigLIP with
    a 980 px position table, `query_num` rows per slice; `head_dims` the tiny and the small
    decoder's (0: left out, the model never reads it); `tiny` the tiny shape's heads and queries
    (those of the version's golden checkpoint); `official`: fields of every size."""
    return {
        "tiny": dict(
            vocab_size=1024,
            text=dict(hidden_size=256, intermediate_size=128, num_hidden_layers=2, head_dim=head_dims[0],
                      num_attention_heads=tiny["heads"], num_key_value_heads=tiny["kv_heads"]),
            vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        image_size=980, patch_size=14),
            query_num=tiny["query_num"], scale_resolution=112, max_slice_nums=4, **official),
        "small": dict(
            vocab_size=8192,
            text=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=head_dims[1]),
            vision=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4,
                        image_size=980, patch_size=14),
            query_num=64, scale_resolution=448, max_slice_nums=9, **official),
    }


def _longrope(head_dim: int) -> dict[str, Any]:
    """LongRoPE as MiniCPM-V 4.0 configures it: one factor per rotary frequency, rising from about
    1 to about 31 (the official ones' range), the same short and long (`factor` 1)."""
    n = head_dim // 2
    factors = [1.0 + 30.0 * (i / (n - 1)) ** 2 for i in range(n)]
    return dict(rope_type="longrope", factor=1.0, short_factor=factors, long_factor=list(factors),
                original_max_position_embeddings=32768)


def _write(out: Path, shape: dict[str, Any], tokenizer, seed: int, *, version: float) -> None:
    """A random-weight checkpoint of MiniCPM-V `version` as the official remote code reads it."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from triton_vlm.families.minicpmv.tower_resampler import MiniCPMVVisionTower, vision_settings

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in shape["tokens"]}
    patch, sizes = shape["vision"]["patch_size"], dict(shape["text"])
    if not sizes["head_dim"]:  # a model that never reads it (2.6's Qwen2)
        sizes.pop("head_dim")
    eos = [ids[t] for t in shape["config_eos"]]
    text = dict(vocab_size=shape["model_vocab_size"], rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                bos_token_id=ids[shape["bos"]], eos_token_id=eos[0] if len(eos) == 1 else eos, **sizes)
    config = dict(version=version, architectures=["MiniCPMV"], model_type="minicpmv", **text, **shape["text_fields"],
                  vision_config=dict(model_type=shape["vision_model_type"], **shape["vision"]),
                  query_num=shape["query_num"],
                  image_size=shape["scale_resolution"], patch_size=patch, slice_mode=True, batch_vision_input=True,
                  drop_vision_last_layer=False, **shape["fields"])
    if shape["longrope"]:
        config["rope_scaling"] = _longrope(sizes["head_dim"])
    if "head_dim" in text:  # (transformers 5 wants the heads to divide hidden_size even then; 4.51 did not)
        llm_config = getattr(transformers, f"{shape['llm']}Config")(**{**text, "num_attention_heads": 1})
        llm_config.num_attention_heads = text["num_attention_heads"]
    else:
        llm_config = getattr(transformers, f"{shape['llm']}Config")(**text)
    llm = random_model(getattr(transformers, f"{shape['llm']}ForCausalLM"), llm_config, shape, seed)
    tower = random_model(MiniCPMVVisionTower, vision_settings(config), shape, seed + 1)
    with torch.no_grad():  # (the module starts them at zero: the checkpoint sets them)
        tower.resampler.query.normal_(std=0.02)
        tower.resampler.proj.normal_(std=tower.resampler.proj.shape[0] ** -0.5)
    weights = {f"llm.{name}": value for name, value in llm.state_dict().items()} | tower.state_dict()
    save_file({name: value.contiguous() for name, value in weights.items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    numbered = dict(use_image_id=True, slice_mode=True) if rc.IMAGE_ID_START in shape["tokens"] else {}
    processor = dict(image_processor_type="MiniCPMVImageProcessor", processor_class="MiniCPMVProcessor",
                     max_slice_nums=shape["max_slice_nums"], scale_resolution=shape["scale_resolution"],
                     patch_size=patch, **numbered, image_feature_size=shape["query_num"],
                     norm_mean=[0.5] * 3, norm_std=[0.5] * 3, version=shape["processor_version"],
                     **{key: token for key, token in rc.NAMED_TOKENS.items()
                        if key != "unk_token" and token in shape["tokens"]}, unk=rc.UNK)
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    if shape["bos_first"]:  # a Llama tokenizer: `<s>` before every text
        from tokenizers import processors

        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{shape['bos']} $A", pair=f"{shape['bos']} $A {shape['bos']} $B",
            special_tokens=[(shape["bos"], ids[shape["bos"]])])
        tokenizer.bos_token = shape["bos"]
    tokenizer.chat_template = shape["chat_template"]
    tokenizer.save_pretrained(out)


def _version(tokens: tuple[str, ...], version: float, *, llm: str, head_dims: tuple[int, int], tiny: dict[str, int],
             bos: str, eos: tuple[str, ...], chat: str, processor_version: float, longrope: bool = False,
             bos_first: bool = False, vision_model_type: str = "siglip", **fields: Any) -> Demo:
    """The demo of one version: its tokenizer's special tokens (with `<image_id>`, a processor
    config numbering images), `llm` its decoder's transformers class prefix, its config's bos and
    eos tokens, the processor config's `version` (the official files' own: 4.0's says 3.0, 4.5's
    2.6), its vision config's `model_type`, `fields` its own official config fields."""
    official = dict(tokens=tokens, config_eos=eos, bos=bos, llm=llm, chat_template=chat,
                    processor_version=processor_version, longrope=longrope, bos_first=bos_first,
                    vision_model_type=vision_model_type,
                    text_fields={k: fields.pop(k) for k in list(fields) if k in TEXT_FIELDS}, fields=fields)
    return Demo(_sizes(head_dims, tiny, **official), partial(_write, version=version))


# Text fields of the official configs beyond the sizes (the rest are MiniCPM-V's own).
TEXT_FIELDS = ("max_position_embeddings", "rope_theta", "attention_bias", "mlp_bias", "sliding_window",
               "use_sliding_window", "max_window_layers", "attention_dropout", "pad_token_id", "pretraining_tp")

ENDOFTEXT = MINICPMV2_6.prompt.special_tokens[0]
DEMOS = {
    "minicpmv2_5": _version(
        MINICPMV2_5.prompt.special_tokens, 2.5, llm="Llama", head_dims=(0, 0),
        tiny=dict(heads=4, kv_heads=2, query_num=16), bos="<|begin_of_text|>", eos=("<|end_of_text|>",),
        chat=MINICPMV2_5_TEMPLATE, processor_version=2.5, bos_first=True, vision_model_type="idefics2",
        max_position_embeddings=8192, rope_theta=500000.0, attention_bias=False, attention_dropout=0.0,
        pretraining_tp=1, mm_use_im_start_end=True, slice_config=dict(max_slice_nums=9, patch_size=14,
                                                                       model_type="minicpmv")),
    "minicpmv2_6": _version(
        MINICPMV2_6.prompt.special_tokens, 2.6, llm="Qwen2", head_dims=(0, 0),
        tiny=dict(heads=4, kv_heads=2, query_num=16), bos=ENDOFTEXT,
        eos=(rc.IM_END,), chat=MINICPMV2_6_TEMPLATE, processor_version=2.6, max_position_embeddings=32768,
        rope_theta=1000000.0, sliding_window=131072, use_sliding_window=False, max_window_layers=2,
        attention_dropout=0.0, slice_config=dict(max_slice_nums=9, patch_size=14, model_type="minicpmv")),
    "minicpmv4_0": _version(
        MINICPMV4_0.prompt.special_tokens, 4.0, llm="Llama", head_dims=(128, 128),
        tiny=dict(heads=3, kv_heads=1, query_num=16), bos="<s>",
        eos=("</s>", rc.IM_END), chat=MINICPMV4_0_TEMPLATE, processor_version=3.0, longrope=True, bos_first=True,
        max_position_embeddings=32768, rope_theta=10000.0, attention_bias=False, mlp_bias=False, pretraining_tp=1,
        use_image_id=True),
    "minicpmv4_5": _version(
        MINICPMV4_5.prompt.special_tokens, 4.5, llm="Qwen3", head_dims=(16, 64),
        tiny=dict(heads=4, kv_heads=2, query_num=8), bos=ENDOFTEXT,
        eos=(rc.IM_END,), chat=MINICPMV4_5_TEMPLATE, processor_version=2.6, max_position_embeddings=4096,
        rope_theta=1000000.0, attention_bias=False, batch_3d_resampler=True),
}
