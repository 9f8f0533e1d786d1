"""Our demo checkpoints with their configs as others write them (issue #39), the weights unchanged.

Every family's tests ran on checkpoints our own writer (`triton_vlm.families.demo`) writes, so an
optional key it always sets, or always leaves out, never varied. Two variants of a tiny checkpoint:

- "bare": `config.json` and the processor config exactly as transformers' own classes write them
  when given only the sizes and token ids (`AutoConfig.for_model(model_type, **sizes)`, the image,
  video and processor classes given only theirs): every optional key at its class default. The
  writer's sizes are chosen so that those defaults fit (`BARE_SHAPES`: a head wide enough for the
  default `mrope_section`).
- "varied": the optional rope, vision and processor keys set away from our writer's values, in the
  older spellings published checkpoints use (`rope_scaling`, `rope_theta` beside it, `torch_dtype`,
  a Qwen2.5-VL config without `text_config`, `preprocessor_config.json` files, `min_pixels`), keys
  transformers ignores (`mrope_interleaved`) and keys left out (`VARIED`).

MiniCPM-V 2.5, 2.6, 4.0 and 4.5 have no transformers class: their bare config is the official one their
golden set carries (`tests/golden/minicpmv*`, written by the official `MiniCPMVConfig`), and their
varied one respells that in ways the official code reads the same (`write_golden_variant`).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

KINDS = ("bare", "varied")

# Keys whose values are sizes: they fix the weights' shapes (and the layer structure), so a bare
# config keeps them. Token ids (`*_token_id`, `*_token_index`, MiniCPM-V 4.7's `*_id` markers) are
# kept too, but for bos / eos / pad, which generation_config.json carries.
SIZE_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "depth", "num_heads", "out_hidden_size", "embed_dim", "mlp_ratio", "patch_size",
    "image_size",
    "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace",
    "num_local_experts", "num_experts", "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "num_position_embeddings", "deepstack_visual_indexes",
    "insert_layer_id", "downsample_mode", "image_grid_pinpoints", "vision_feature_layer",
    "vision_feature_select_strategy", "mm_tokens_per_image"})
GENERATION_IDS = frozenset({"bos_token_id", "eos_token_id", "pad_token_id"})
# Processor keys that must agree with the model's sizes (patch and tile sizes, tokens per view).
PROCESSOR_SIZE_KEYS = frozenset({
    "patch_size", "temporal_patch_size", "merge_size", "downsample_mode", "crop_size", "image_grid_pinpoints",
    "num_additional_image_tokens", "num_image_tokens", "vision_feature_select_strategy", "image_seq_length"})
# Processor size dicts that are tile sizes (LLaVA's), not pixel budgets (Qwen's, GLM's).
TILE_SIZED = ("CLIPImageProcessor", "SiglipImageProcessor", "LlavaOnevisionImageProcessor",
              "LlavaOnevisionVideoProcessor", "GotOcr2ImageProcessor", "InternVLVideoProcessor",
              "Gemma3ImageProcessor")

# Writer shapes of the bare variants: heads wide enough for the text config class's default
# `mrope_section` (Qwen2.5-VL: [16, 24, 24] of a 128-wide head; GLM: [8, 12, 12] of its rotary
# dims, the whole head by default, half of it in GLM-4.5V).
_GLM_BARE = {"text": {"hidden_size": 128, "num_attention_heads": 2, "mrope_section": [4, 6, 6]}}
_QWEN_BARE = {"text": {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
                        "mrope_section": [16, 24, 24]}}
BARE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": _QWEN_BARE, "qwen2_vl": _QWEN_BARE,
    **{name: _GLM_BARE for name in ("glm4v", "glm46v", "glmga", "glm_ocr")},
    "glm4v_moe": {"text": {"hidden_size": 256, "num_attention_heads": 2, "mrope_section": [8, 12, 12]}},
    # Qwen3.5's class pattern (a full-attention layer every 4th) over the writer's every 2nd
    **{name: {"text": {"full_attention_interval": 4}} for name in ("qwen3_5", "qwen3_5_moe")},
    # InternViT's class default: no qkv bias
    "internvl": {"vision": {"attention_bias": False}},
}


def _bare_section(section: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in section.items()
            if k in SIZE_KEYS or (k.endswith(("_token_id", "_token_index", "_id")) and k not in GENERATION_IDS)}


def bare_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config.json` as transformers writes it for a model of `config`'s sizes and token ids."""
    from transformers import AutoConfig

    kwargs = _bare_section(config)
    for sub in ("text_config", "vision_config"):
        if isinstance(config.get(sub), dict):
            kwargs[sub] = _bare_section(config[sub]) | {"model_type": config[sub]["model_type"]}
    made = AutoConfig.for_model(config["model_type"], **kwargs)
    made.architectures, made.dtype = list(config["architectures"]), config.get("dtype", "float32")
    return json.loads(made.to_json_string(use_diff=False))


def bare_processor(checkpoint: Path, out: Path) -> None:
    """The checkpoint's processor classes, given only the sizes they share with the model, saved."""
    import transformers
    from transformers import AutoTokenizer

    saved = json.loads((checkpoint / "processor_config.json").read_text())

    def make(section: dict[str, Any], type_key: str):
        kwargs = {k: v for k, v in section.items() if k in PROCESSOR_SIZE_KEYS}
        if section[type_key] in TILE_SIZED:
            kwargs["size"] = section["size"]
        return getattr(transformers, section[type_key])(**kwargs)

    parts = {"image_processor": make(saved["image_processor"], "image_processor_type")}
    if "video_processor" in saved:
        parts["video_processor"] = make(saved["video_processor"], "video_processor_type")
    own = {k: v for k, v in saved.items() if k in PROCESSOR_SIZE_KEYS}
    processor = getattr(transformers, saved["processor_class"])(
        tokenizer=AutoTokenizer.from_pretrained(checkpoint), **parts, **own,
        chat_template=(checkpoint / "chat_template.jinja").read_text())
    processor.save_pretrained(out)


def _copy(checkpoint: Path, out: Path) -> None:
    """`checkpoint`'s files in `out`: the configs copied, the rest (weights) linked."""
    out.mkdir(parents=True, exist_ok=True)
    for path in checkpoint.iterdir():
        if path.suffix in (".json", ".jinja"):
            shutil.copy2(path, out / path.name)
        elif path.is_file():
            (out / path.name).symlink_to(path.resolve())


def write_variant(family: str, kind: str, out: Path) -> Path:
    """A tiny demo checkpoint of `family` in `out`, with its configs as `kind` says."""
    from triton_vlm.families.demo import write_demo_checkpoint

    out = Path(out)
    source = write_demo_checkpoint(family, out.with_name(out.name + "-writer"), "tiny",
                                   overrides=BARE_SHAPES.get(family) if kind == "bare" else None)
    return derive_variant(source, family, kind, out)


def derive_variant(source: Path, family: str, kind: str, out: Path) -> Path:
    """`source` (a checkpoint our writer wrote, of `BARE_SHAPES`' sizes for "bare") in `out`, its
    configs as `kind` says, its weights linked."""
    _copy(source, out)
    config = json.loads((source / "config.json").read_text())
    if kind == "bare":
        (out / "config.json").write_text(json.dumps(bare_config(config), indent=2))
        bare_processor(source, out)
        return out
    processor = json.loads((source / "processor_config.json").read_text())
    VARIED[family](config, processor)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_processor(out, processor)
    return out


def write_processor(out: Path, processor: dict[str, Any]) -> None:
    """`processor` as v5 saves it (`processor_config.json`), or, where it says `layout: "files"`, as
    older checkpoints do: `preprocessor_config.json` (the image processor, `processor_class`),
    `video_preprocessor_config.json` (none where `video_processor` is None: videos then take the
    image processor's settings) and the processor's own keys, if any, in `processor_config.json`."""
    (out / "processor_config.json").unlink()
    if processor.pop("layout", "nested") == "nested":
        (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
        return
    image, video = processor.pop("image_processor"), processor.pop("video_processor", None)
    image["processor_class"] = processor.pop("processor_class")
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    if video is not None:
        (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    if processor:
        (out / "processor_config.json").write_text(json.dumps(processor, indent=2))


# ---- the varied configs ---------------------------------------------------------------------------

def _old_rope(text: dict[str, Any], theta: float, **rope: Any) -> None:
    """`rope_parameters` respelled as `rope_scaling` (type, sections and flags) with `rope_theta`
    and `partial_rotary_factor` beside it, as transformers 4.x wrote them."""
    params = text.pop("rope_parameters")
    text["rope_theta"] = theta
    if "partial_rotary_factor" in params:
        text["partial_rotary_factor"] = params["partial_rotary_factor"]
    text["rope_scaling"] = {"type": params.get("rope_type", "default"),
                            **{k: v for k, v in params.items() if k == "mrope_section"}, **rope}


def _torch_dtype(config: dict[str, Any]) -> None:
    config["torch_dtype"] = config.pop("dtype")


_QWEN_KEEP = ("image_mean", "image_std", "patch_size", "temporal_patch_size", "merge_size")


def _qwen_hub(config: dict[str, Any], processor: dict[str, Any], **text_keys: Any) -> None:
    """Qwen's hub configs: no `text_config` (its fields at the top level, `text_keys` among them),
    `rope_scaling` of type "mrope" with `rope_theta` beside it (another value), an ignored
    `mrope_interleaved`, no `rms_norm_eps` (the class's 1e-5), `torch_dtype`, the vision tower's
    `in_chans` and another rope theta; `preprocessor_config.json` files, the image processor's
    budgets as `min_pixels` / `max_pixels`."""
    text = config.pop("text_config")
    _old_rope(text, 500000.0, mrope_interleaved=True)
    text["rope_scaling"]["type"] = "mrope"
    for key in ("rms_norm_eps", "model_type", "layer_types", "dtype"):
        text.pop(key, None)
    config.update(text, **text_keys)
    _torch_dtype(config)
    vision = config["vision_config"]
    vision["in_chans"] = vision.pop("in_channels")
    vision["rope_parameters"] = {"rope_type": "axial", "rope_theta": 5000.0}
    image = processor["image_processor"]
    keep = (*_QWEN_KEEP, "image_processor_type")
    processor["image_processor"] = {k: image[k] for k in keep} | {"min_pixels": 8 * 28 * 28, "max_pixels": 96 * 28 * 28}
    processor["layout"] = "files"


def _qwen2_5_vl(config: dict[str, Any], processor: dict[str, Any]) -> None:
    """Qwen2.5-VL as Qwen's hub configs have it (`_qwen_hub`), with a `partial_rotary_factor` its
    rotary ignores, other windows and full-attention blocks, no `tokens_per_second` (the class's 4);
    no video processor file (videos take the image settings)."""
    _qwen_hub(config, processor, partial_rotary_factor=0.5)
    vision = config["vision_config"]
    vision.pop("tokens_per_second")
    vision.update(model_type="qwen2_5_vl", window_size=56, fullatt_block_indexes=[0, 2])
    processor["video_processor"] = None


def _qwen2_vl(config: dict[str, Any], processor: dict[str, Any]) -> None:
    """Qwen2-VL as Qwen's hub configs have it (`_qwen_hub`: transformers reads no `in_chans`, its 3
    channels); a `video_preprocessor_config.json` that samples (`do_sample_frames`, `fps` 1, where
    the class has no rate and takes every frame) within other budgets."""
    _qwen_hub(config, processor)
    video = processor["video_processor"]
    keep = (*_QWEN_KEEP, "video_processor_type")
    processor["video_processor"] = {k: video[k] for k in keep} | {
        "min_pixels": 4 * 28 * 28, "max_pixels": 32 * 28 * 28, "do_sample_frames": True, "fps": 1.0}


def _glm(model_type: str | None = None, files: bool = False) -> Callable[[dict, dict], None]:
    def vary(config: dict[str, Any], processor: dict[str, Any]) -> None:
        """GLM as transformers 4.x saved it: `rope_scaling` with `rope_theta` and
        `partial_rotary_factor` beside it (other values), an ignored `mrope_interleaved`,
        `rms_norm_eps` away from the writer's, `torch_dtype`, the text config's true
        `tie_word_embeddings` under a false top level (only `Glm4vConfig`, GLM-OCR's and GLM-4.5V's
        classes forward it), another vision rope theta; the processor's pixel budgets and video
        sampling (`fps`, `max_duration`) changed; GLM-4.6V and GLMGA under `model_type` glm4v."""
        text = config["text_config"]
        _old_rope(text, 20000.0, mrope_interleaved=True)
        text.update(rms_norm_eps=1e-6, tie_word_embeddings=True)
        _torch_dtype(config)
        config["vision_config"]["rope_parameters"]["rope_theta"] = 5000.0
        if model_type:
            config["model_type"] = model_type
        image, video = processor["image_processor"], processor["video_processor"]
        image["size"] = {"shortest_edge": 56 * 56, "longest_edge": 128 * 28 * 28}
        video["size"] = {"shortest_edge": 56 * 56, "longest_edge": 2 * 48 * 28 * 28}
        video.update(fps=1, max_duration=20)
        if files:
            processor["layout"] = "files"
    return vary


def _qwen3_vl(config: dict[str, Any], processor: dict[str, Any]) -> None:
    """Qwen3-VL as published checkpoints may have it: `torch_dtype`, an ignored false
    `mrope_interleaved` (the model always interleaves), another rope theta and `rms_norm_eps`;
    `preprocessor_config.json` and `video_preprocessor_config.json` files, other pixel budgets,
    videos sampled at 1 fps down to 2 frames."""
    text = config["text_config"]
    text["rope_parameters"].update(rope_theta=1000000.0, mrope_interleaved=False)
    text["rms_norm_eps"] = 1e-5
    _torch_dtype(config)
    image, video = processor["image_processor"], processor["video_processor"]
    image["size"] = {"shortest_edge": 8 * 32 * 32, "longest_edge": 96 * 32 * 32}
    video["size"] = {"shortest_edge": 8 * 32 * 32, "longest_edge": 4 * 48 * 32 * 32}
    video.update(fps=1, min_frames=2)
    processor["layout"] = "files"


def _qwen3_5(config: dict[str, Any], processor: dict[str, Any]) -> None:
    """Qwen3.5 (-MoE): Qwen3-VL's processor variations (`_qwen3_vl`); its text config in the
    older rope spelling (`rope_scaling`, `rope_theta` and `partial_rotary_factor` beside it) with
    another theta, partial rotary and `mrope_section`, an ignored false `mrope_interleaved`, and
    `full_attention_interval` instead of `layer_types` (transformers makes the same layers of it)."""
    _qwen3_vl(config, processor)
    text = config["text_config"]
    _old_rope(text, 2e6, mrope_interleaved=False, mrope_section=[3, 3, 2])
    text["partial_rotary_factor"] = 0.5
    types = text.pop("layer_types")
    text["full_attention_interval"] = types.index("full_attention") + 1


def _minicpmv(config: dict[str, Any], processor: dict[str, Any]) -> None:
    """MiniCPM-V 4.6 / 4.7 / OCR with `mrope_interleaved` false (transformers' Qwen3.5 interleaves
    whatever it says), another `rope_theta`, `partial_rotary_factor` and `mrope_section`, in
    `rope_scaling`; no `layer_types` (the class's every-4th-layer pattern); the text config's
    `tie_word_embeddings` flipped (its class reads only the top level's); the vision tower's
    `insert_layer_id` away from the top level's (which transformers copies over it); the
    processor's slice sizes, slice counts and image ids changed, in `preprocessor_config.json` files."""
    text = config["text_config"]
    _old_rope(text, 1e6, mrope_interleaved=False, mrope_section=[3, 3, 2])
    text["partial_rotary_factor"] = 0.5
    text.pop("layer_types")
    text["tie_word_embeddings"] = not config["tie_word_embeddings"]
    config.pop("tie_word_embeddings")
    _torch_dtype(config)
    config["vision_config"]["insert_layer_id"] = 1
    for section in (processor["image_processor"], processor["video_processor"]):
        section.update(scale_resolution=140, max_slice_nums=2, use_image_id=False)
    processor["video_processor"].update(max_num_frames=3)
    processor["layout"] = "files"


def _llava(config: dict[str, Any], processor: dict[str, Any]) -> None:
    """LLaVA with `rope_scaling` carrying another `rope_theta`, `torch_dtype`, the text config's
    true `tie_word_embeddings` under a false top level (`LlavaConfig` forwards it), another feature
    layer and projector activation, an ignored `image_seq_length`; the CLIP processor resizing to
    a larger edge before its centre crop, other means and deviations, and no `do_center_crop` (its
    class's True)."""
    text = config["text_config"]
    text.pop("rope_parameters")
    text["rope_scaling"] = {"rope_type": "default", "rope_theta": 40000.0}
    text["tie_word_embeddings"] = True
    _torch_dtype(config)
    config.update(vision_feature_layer=-3, projector_hidden_act="gelu_pytorch_tanh", image_seq_length=7)
    image = processor["image_processor"]
    image.pop("do_center_crop")
    image.update(size={"shortest_edge": image["size"]["shortest_edge"] + 16}, image_mean=[0.5, 0.4, 0.3],
                 image_std=[0.2, 0.25, 0.3])


def _llava_onevision(config: dict[str, Any], processor: dict[str, Any]) -> None:
    """LLaVA-OneVision with `rope_theta` beside `rope_scaling`, `torch_dtype`, the forwarded text
    `tie_word_embeddings`, no feature layer and strategy (its class's last layer, "full"), another
    projector activation, a smaller `vision_aspect_ratio` (model and processor); other means and
    deviations, in a `preprocessor_config.json`."""
    text = config["text_config"]
    _old_rope(text, 2e5)
    text["tie_word_embeddings"] = True
    _torch_dtype(config)
    for key in ("vision_feature_layer", "vision_feature_select_strategy"):
        config.pop(key)
    config.update(projector_hidden_act="gelu_pytorch_tanh", vision_aspect_ratio="anyres_max_2")
    processor["vision_aspect_ratio"] = "anyres_max_2"
    for section in (processor["image_processor"], processor["video_processor"]):
        section.update(image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3])
    processor["layout"] = "files"


def _internvl(config: dict[str, Any], processor: dict[str, Any]) -> None:
    """InternVL with `rope_theta` beside `rope_scaling`, `torch_dtype`, the text config's true
    `tie_word_embeddings` under a false top level (`InternVLConfig` reads the top level's only),
    another projector activation and tower `layer_norm_eps`, no `use_mean_pooling` (its class's
    True); the image processor's `max_patches` 4, other means and deviations, a saved
    `crop_to_patches` false (the processor's own true wins), in `preprocessor_config.json` files."""
    text = config["text_config"]
    _old_rope(text, 2e5)
    text["tie_word_embeddings"] = True
    _torch_dtype(config)
    config["projector_hidden_act"] = "gelu_pytorch_tanh"
    config["vision_config"]["layer_norm_eps"] = 1e-5
    config["vision_config"].pop("use_mean_pooling")
    processor["image_processor"].update(max_patches=4, crop_to_patches=False)
    for section in (processor["image_processor"], processor["video_processor"]):
        section.update(image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3])
    processor["layout"] = "files"


def _gemma3(config: dict[str, Any], processor: dict[str, Any]) -> None:
    """Gemma 3 as 4.x configs spell it: `rope_scaling` (linear, another factor) with `rope_theta` and
    `rope_local_base_freq` beside it, `sliding_window_pattern` instead of `layer_types` (another
    pattern: 2 sliding to 1 full), no `query_pre_attn_scalar` (its class's 256), another window,
    `torch_dtype`; the image processor config asking for pan-and-scan (the processor turns it off),
    other means and deviations, in a `preprocessor_config.json`."""
    text = config["text_config"]
    text.pop("rope_parameters")
    text.update(rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_theta=500000.0, rope_local_base_freq=20000.0,
                sliding_window_pattern=3, sliding_window=9)
    for key in ("layer_types", "query_pre_attn_scalar", "_sliding_window_pattern"):
        text.pop(key, None)
    _torch_dtype(config)
    processor["image_processor"].update(do_pan_and_scan=True, image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3])
    processor["layout"] = "files"


VARIED: dict[str, Callable[[dict, dict], None]] = {
    "qwen2_5_vl": _qwen2_5_vl, "qwen2_vl": _qwen2_vl, "glm4v": _glm(files=True), "glm46v": _glm("glm4v"), "glmga": _glm("glm4v", files=True),
    "glm_ocr": _glm(), "glm4v_moe": _glm(files=True), "minicpmv4_6": _minicpmv, "minicpmv4_7": _minicpmv,
    "minicpm_ocr": _minicpmv, "llava": _llava, "llava_onevision": _llava_onevision, "internvl": _internvl,
    "qwen3_vl": _qwen3_vl, "qwen3_vl_moe": _qwen3_vl, "qwen3_5": _qwen3_5, "qwen3_5_moe": _qwen3_5,
    "gemma3": _gemma3,
}


# ---- MiniCPM-V 2.6, 4.0, 4.5: the official config (the golden set's), respelled as the official code reads it alike ----

# Keys the official `MiniCPMVConfig` (4.5: a transformers 4.51 `Qwen3Config`; 2.6: a 4.40 `Qwen2Config`;
# 4.0: a 4.51 `LlamaConfig`) and `MiniCPMVImageProcessor` default to the golden set's values: left
# out, they read the same.
GOLDEN_DEFAULTED = {
    "minicpmv4_5": ("rope_scaling", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "attention_bias",
                    "hidden_act", "use_sliding_window", "sliding_window", "max_window_layers", "use_cache",
                    "attention_dropout", "initializer_range", "slice_mode", "batch_vision_input"),
    "minicpmv2_6": ("hidden_act", "initializer_range", "max_position_embeddings", "rms_norm_eps", "use_cache",
                    "tie_word_embeddings", "use_sliding_window", "attention_dropout", "slice_mode",
                    "batch_vision_input"),
    "minicpmv4_0": ("attention_bias", "mlp_bias", "attention_dropout", "hidden_act", "pretraining_tp", "rms_norm_eps",
                    "rope_theta", "tie_word_embeddings", "use_cache", "use_image_id", "vision_batch_size",
                    "slice_mode", "batch_vision_input"),
    # 2.5: transformers 4.40's `LlamaConfig` (no `mlp_bias` yet) and 2.5's `MiniCPMVConfig`.
    "minicpmv2_5": ("attention_bias", "attention_dropout", "hidden_act", "initializer_range", "pretraining_tp",
                    "rope_scaling", "tie_word_embeddings", "slice_mode", "batch_vision_input"),
    # 2.0: its `MiniCPMConfig` (a Llama-like config of transformers 4.36) and `MiniCPMVConfig`, which
    # also holds the image processing's settings (no processor config).
    "minicpmv2_0": ("attention_bias", "attention_dropout", "hidden_act", "pretraining_tp", "rope_scaling", "rope_theta",
                    "use_cache", "slice_mode", "max_slice_nums", "scale_resolution", "patch_size"),
}
GOLDEN_PROCESSOR_DEFAULTED = {
    "minicpmv4_5": ("version", "use_image_id", "norm_mean", "norm_std", "slice_mode"),
    "minicpmv2_6": ("version", "max_slice_nums", "scale_resolution", "patch_size", "norm_mean", "norm_std",
                    "slice_mode"),
}
GOLDEN_PROCESSOR_DEFAULTED["minicpmv4_0"] = GOLDEN_PROCESSOR_DEFAULTED["minicpmv2_6"]
# 2.5's `MiniCPMVImageProcessor(max_slice_nums=9, scale_resolution=448, patch_size=14)`.
GOLDEN_PROCESSOR_DEFAULTED["minicpmv2_5"] = ("max_slice_nums", "scale_resolution", "patch_size")


def write_golden_variant(golden: Path, out: Path, **processor: Any) -> Path:
    """The golden checkpoint with `torch_dtype` as v5 spells it (`dtype`) and the keys whose
    official defaults are its values left out; `processor`: processor config keys set on top."""
    _copy(golden, out)
    config = json.loads((golden / "config.json").read_text())
    config["dtype"] = config.pop("torch_dtype")
    for key in GOLDEN_DEFAULTED[golden.name]:
        config.pop(key)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    path = golden / "preprocessor_config.json"
    if path.is_file() or processor:  # (2.0 has none: its model code processes its images)
        image = json.loads(path.read_text()) if path.is_file() else {}
        image = {k: v for k, v in image.items() if k not in GOLDEN_PROCESSOR_DEFAULTED.get(golden.name, ())} | processor
        (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    return out
