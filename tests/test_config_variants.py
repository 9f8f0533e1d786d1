"""Issue #39: every family exact on checkpoints whose configs are written as others write them.

- The defect: the M-RoPE layout is the text model's, whatever `mrope_interleaved` says.
- Every family on each config variant of `tests/config_variants.py` ("bare": transformers' own
  classes' output for the sizes, every optional key at its default; "varied": optional keys moved
  away from our writer's values, older spellings, ignored and missing keys): the code the server
  runs, in this process (`Preprocessor`, the family's tower as `TorchEncoder`, the module the ONNX
  export is traced from, and the `Engine`) against transformers on the same checkpoint: input ids,
  positions, the embedding rows its text model receives where the placeholders stand, the greedy
  tokens and every step's logits; the text config as read against the model transformers builds.
  Served through a real tritonserver: Qwen2.5-VL's varied config here, every other family's
  `tests/test_e2e_*.py` on one of its variants.
- MiniCPM-V 4.5 (no transformers class): its golden config respelled gives the official outputs.
- Defaults: a config that leaves a key out reads as transformers' class fills it in (text, vision
  and processor configs).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.config_variants import GOLDEN_DEFAULTED, KINDS, write_variant
from tests.oracle import Oracle, decode_frames
from triton_vlm.families import FAMILIES
from triton_vlm.media import samples

NEW_TOKENS = 6
IMAGE = samples.image_bytes(200, 150)
VIDEO = samples.video_bytes(seconds=2.0, fps=4, width=280, height=200)
FAMILY_NAMES = [name for name in FAMILIES if name not in GOLDEN_DEFAULTED]  # (those: their golden sets)


# transformers' GLM cannot generate from an image and a video in one prompt (its video mask also
# selects the image tokens): they go in prompts of their own.
MEDIA_APART = ("glm4v", "glm46v", "glmga", "glm_ocr", "glm4v_moe")


def requests(family: str) -> list[tuple[str, list[bytes], list[bytes]]]:
    """An image, a video where the family takes them, and text."""
    f = FAMILIES[family]
    image = (f.image_placeholder, [IMAGE], [])
    if not f.processor.takes_videos:
        return [(image[0] + "what is it?", image[1], [])]
    video = (f.video_placeholder, [], [VIDEO])
    if family in MEDIA_APART:
        return [(image[0] + "what is it?", image[1], []), (video[0] + "what moves?", [], video[2])]
    return [(image[0] + "and" + video[0] + "what is it?", image[1], video[2])]


def hf_inputs(oracle: Oracle, family: str, prompt: str, images, videos) -> dict:
    """The processor's inputs, videos sampled as the server samples them: by the family's rule
    (the checkpoint's, else every frame where the family has none); Qwen2.5-VL's video processor
    (Qwen2-VL's) samples only when given a rate, which the server takes from the checkpoint, else
    2 fps. Qwen2-VL has no rate of its own: its checkpoint's config says whether it samples."""
    import io

    from PIL import Image

    kwargs = {"images": [Image.open(io.BytesIO(b)).convert("RGB") for b in images]} if images else {}
    if videos:
        decoded = [decode_frames(v) for v in videos]
        kwargs.update(videos=[f for f, _ in decoded], video_metadata=[m for _, m in decoded])
        rules = FAMILIES[family].processor
        if rules.sample_frames is not None and rules.default_video_fps is not None:
            kwargs["do_sample_frames"] = True
        if family == "qwen2_5_vl":
            kwargs["fps"] = oracle.processor.video_processor.fps or FAMILIES[family].processor.default_video_fps
    return oracle.processor(text=[prompt], return_tensors="pt", **kwargs)


@torch.no_grad()
def hf_run(oracle: Oracle, family: str, prompt: str, images, videos) -> dict:
    """transformers on the request: the processor's ids, what its text model receives on the
    prompt (input embeddings, positions) and `generate`'s greedy tokens and logits."""
    inputs = hf_inputs(oracle, family, prompt, images, videos)
    seen = {}
    text_model = oracle.model.model.language_model
    hook = text_model.register_forward_pre_hook(lambda _m, _a, kwargs: seen.setdefault("prompt", kwargs) and None,
                                                with_kwargs=True)
    try:
        out = oracle.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
    finally:
        hook.remove()
    positions = seen["prompt"].get("position_ids")  # [S], [1, S] or (M-RoPE) [3 or 4, 1, S]
    if positions is not None:
        positions = positions.numpy().reshape(-1, positions.shape[-1])[-3:]
    return dict(input_ids=inputs["input_ids"][0].numpy(), embeds=seen["prompt"]["inputs_embeds"][0],
                positions=positions, deepstack=seen["prompt"].get("deepstack_visual_embeds"),
                tokens=out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), logits=out.logits)


def assert_prompt_equals_hf(want: dict, input_ids, positions, embeddings, placeholder_ids) -> None:
    """Ids and positions are transformers' (`hf_run`), and so is each embedding row its text model
    receives where the prompt's placeholders stand, with its DeepStack maps where it takes them
    (the contract's `embedding_width`)."""
    np.testing.assert_array_equal(input_ids, want["input_ids"])
    if want["positions"] is not None:
        np.testing.assert_array_equal(positions, np.broadcast_to(want["positions"], positions.shape))
    reference = want["embeds"][torch.from_numpy(np.isin(input_ids, placeholder_ids))]
    reference = torch.cat([reference, *(want["deepstack"] or ())], dim=-1).numpy()
    assert embeddings.shape == reference.shape
    assert np.abs(embeddings - reference).max(initial=0) <= 1e-4 * max(1.0, np.abs(reference).max(initial=0))


@torch.no_grad()
def assert_pipeline_equals_hf(family: str, checkpoint, oracle: Oracle, family_requests: list | None = None) -> None:
    """Preprocess, encoder and engine in this process, as the server runs them, give transformers'
    ids, positions, embedding rows, greedy tokens and logits on each of the family's requests
    (`family_requests`: (prompt, images, videos) each; None: `requests(family)`)."""
    from tests.test_llm import Collector
    from triton_vlm.llm import DecoderConfig, Engine, SamplingParams
    from triton_vlm.preprocessing.preprocessor import Preprocessor
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    preprocessor, encoder = Preprocessor(checkpoint), TorchEncoder(checkpoint)
    placeholder_ids = DecoderConfig.from_checkpoint(checkpoint).placeholder_token_ids
    engine = Engine(checkpoint, return_logits=True, kv_cache_tokens=2048)
    try:
        for i, (prompt, images, videos) in enumerate(family_requests or requests(family)):
            want = hf_run(oracle, family, prompt, images, videos)
            out = preprocessor(prompt, images, videos)
            embeddings = encoder.encode(out.pixel_values, out.grid_thw, out.extras)
            assert_prompt_equals_hf(want, out.input_ids, out.mrope_position_ids, embeddings, placeholder_ids)
            col = Collector()
            engine.submit(f"request-{i}", out.input_ids, embeddings, out.mrope_position_ids,
                          np.array([out.mrope_position_delta], np.int64), SamplingParams(max_tokens=NEW_TOKENS), col)
            col.wait()
            for ours, ref in zip(col.outputs, want["logits"]):
                assert torch.allclose(ours.logits, ref[0], atol=1e-4, rtol=0), (ours.logits - ref[0]).abs().max()
            assert col.ids == want["tokens"]
    finally:
        engine.shutdown()


# ---- the defect ---------------------------------------------------------------------------

# transformers' Qwen3.5 rotary always interleaves the M-RoPE frequencies and never reads
# `mrope_interleaved`; Qwen2.5-VL's and GLM's always lay them in runs. Our writer's checkpoints, the
# key as given here (None: left out), everything else as the writer wrote it. (MiniCPM-V 4.6's and
# MiniCPM-OCR's positions are equal on the three axes, so the layout cannot show there.)
MROPE_INTERLEAVED = [("minicpmv4_7", None), ("minicpmv4_7", False), ("minicpmv4_6", None), ("minicpm_ocr", False),
                     ("qwen2_5_vl", True), ("glm4v", True)]


@pytest.mark.parametrize("family, interleaved", MROPE_INTERLEAVED, ids=lambda v: str(v))
def test_the_mrope_layout_is_the_models_whatever_mrope_interleaved_says(family, interleaved, tmp_path):
    import json

    from triton_vlm.families.demo import write_demo_checkpoint

    checkpoint = write_demo_checkpoint(family, tmp_path / "checkpoint", "tiny")
    config = json.loads((checkpoint / "config.json").read_text())
    rope = config["text_config"]["rope_parameters"]
    rope.pop("mrope_interleaved", None)
    if interleaved is not None:
        rope["mrope_interleaved"] = interleaved
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert_pipeline_equals_hf(family, checkpoint, Oracle(checkpoint))


# ---- every family on config variants ----------------------------------------------------------------

@pytest.fixture(scope="module", params=[(f, k) for f in FAMILY_NAMES for k in KINDS], ids="-".join)
def variant(request, tmp_path_factory):
    family, kind = request.param
    checkpoint = write_variant(family, kind, tmp_path_factory.mktemp(f"{family}-{kind}") / "checkpoint")
    return family, kind, checkpoint, Oracle(checkpoint)


def assert_rotary_is_transformers(ours, rotary, text) -> None:
    """Our rotary frequencies are transformers' rotary's: its one, or one per layer type (the full
    layers' with linear scaling, the sliding layers' of their own theta, Gemma 3's)."""
    thetas = {"": (ours.rope_theta, 1.0)} if hasattr(rotary, "inv_freq") else {
        "full_attention_": (ours.rope_theta, ours.rope_linear_factor),
        "sliding_attention_": (ours.sliding_rope_theta, 1.0)}
    for prefix, (theta, factor) in thetas.items():
        inv_freq = getattr(rotary, prefix + "inv_freq")
        assert ours.rotary_dim == 2 * inv_freq.numel()
        torch.testing.assert_close(1.0 / theta ** (torch.arange(0, ours.rotary_dim, 2) / ours.rotary_dim) / factor,
                                   inv_freq, rtol=1e-6, atol=0)
    if hasattr(rotary, "inv_freq"):
        assert ours.rope_theta == text.rope_parameters["rope_theta"]
    else:
        assert ours.sliding_window == text.sliding_window


def layer_types(ours, text) -> tuple[str, ...]:
    """transformers' layer types as ours: sliding layers that attend fully (no `use_sliding_window`,
    no window of ours) as full ones."""
    types = tuple(getattr(text, "layer_types", None) or ("full_attention",) * ours.num_layers)
    if ours.sliding_window is None:
        types = tuple("full_attention" if t == "sliding_attention" else t for t in types)
    return types


def test_decoder_config_reads_what_transformers_builds(variant):
    """The text config as read, field by field, against the model transformers builds from it."""
    from triton_vlm.llm import DecoderConfig

    _, _, checkpoint, oracle = variant
    ours, model = DecoderConfig.from_checkpoint(checkpoint), oracle.model
    text = model.config.get_text_config()
    rotary = model.model.language_model.rotary_emb
    assert_rotary_is_transformers(ours, rotary, text)
    assert ours.rms_norm_eps == text.rms_norm_eps
    assert ours.tie_word_embeddings == model.config.tie_word_embeddings
    assert set(ours.eos_token_ids) == set(np.atleast_1d(model.generation_config.eos_token_id).tolist())
    assert (ours.num_layers, ours.num_kv_heads) == (text.num_hidden_layers, text.num_key_value_heads)
    assert ours.layer_types == layer_types(ours, text)


def test_pipeline_equals_transformers(variant):
    family, _, checkpoint, oracle = variant
    assert_pipeline_equals_hf(family, checkpoint, oracle)


# ---- served: Qwen2.5-VL's hub-style config through a real tritonserver -----------------------------
# (every other family's tests/test_e2e_*.py serves one of its variants)

@pytest.fixture(scope="module")
def qwen_served(tmp_path_factory):
    from tests.test_e2e import family_server

    with family_server("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl-served"), "varied") as served:
        yield served


def test_qwen2_5_vl_varied_served_equals_transformers(qwen_served):
    """The served ensemble on a Qwen2.5-VL config as Qwen's hub has it (no `text_config`,
    `rope_scaling` of type "mrope", one `preprocessor_config.json`): `preprocess`'s ids and
    positions, `vision_encoder`'s rows and the greedy tokens (gRPC streaming, HTTP) are transformers'."""
    from tests.test_e2e import assert_served_tokens, infer_direct, media_values
    from triton_vlm.llm import DecoderConfig

    server, oracle = qwen_served
    placeholder_ids = DecoderConfig.from_checkpoint(oracle.checkpoint).placeholder_token_ids
    for prompt, images, videos in requests("qwen2_5_vl"):
        want = hf_run(oracle, "qwen2_5_vl", prompt, images, videos)
        out = infer_direct(server, "preprocess", media_values(prompt, images, videos),
                           ["input_ids", "pixel_values", "grid_thw", "mrope_position_ids"])
        encoder_inputs = {"pixel_values": (out["pixel_values"], "FP32"), "grid_thw": (out["grid_thw"], "INT64")}
        embeddings = infer_direct(server, "vision_encoder", encoder_inputs, ["embeddings"])["embeddings"]
        assert_prompt_equals_hf(want, out["input_ids"], out["mrope_position_ids"], embeddings, placeholder_ids)
        assert_served_tokens(server, (prompt, images, videos), want["tokens"], NEW_TOKENS)


# ---- MiniCPM-V 4.5: the official code's golden outputs are the oracle ------------------------------

@pytest.fixture(scope="module")
def golden_variant(tmp_path_factory):
    from tests.config_variants import write_golden_variant
    from tests.minicpmv4_5_golden import GOLDEN

    return write_golden_variant(GOLDEN, tmp_path_factory.mktemp("minicpmv4_5-varied") / "checkpoint")


def golden_image_request(case: str) -> tuple[str, list[bytes]]:
    from tests.minicpmv4_5_golden import CASES, GOLDEN

    return CASES[case]["prompt"], [(GOLDEN / m["file"]).read_bytes() for m in CASES[case]["media"]]


@torch.no_grad()
def test_minicpmv4_5_respelled_config_gives_the_official_outputs(golden_variant, golden):
    """The golden checkpoint without the keys the official classes default, `dtype` for
    `torch_dtype`: ids, vision rows and greedy tokens are still the official ones."""
    from tests.test_llm import Collector
    from triton_vlm.llm import Engine, SamplingParams
    from triton_vlm.preprocessing.preprocessor import Preprocessor
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    case = "a_image_640x480"
    out = Preprocessor(golden_variant)(*golden_image_request(case))
    np.testing.assert_array_equal(out.input_ids, golden[f"{case}/input_ids"])
    embeddings = TorchEncoder(golden_variant).encode(out.pixel_values, out.grid_thw)
    reference = golden[f"{case}/vision_embeds"].reshape(embeddings.shape)
    assert np.abs(embeddings - reference).max() <= 1e-4 * np.abs(reference).max()
    engine = Engine(golden_variant, return_logits=True, kv_cache_tokens=1024)
    try:
        col = Collector()
        engine.submit(case, out.input_ids, embeddings, out.mrope_position_ids, np.zeros(1, np.int64),
                      SamplingParams(max_tokens=8), col)
        col.wait()
    finally:
        engine.shutdown()
    assert col.ids == golden[f"{case}/gen_tokens"].tolist()


def test_minicpmv4_5_reads_norm_mean_and_norm_std_as_the_official_processor(golden_variant, golden, tmp_path):
    """`norm_mean` / `norm_std` (the official spelling) normalise the official processor's pixels."""
    from tests.config_variants import write_golden_variant
    from tests.minicpmv4_5_golden import GOLDEN
    from tests.minicpmv_golden import golden_rows
    from triton_vlm.preprocessing.preprocessor import Preprocessor

    mean, std = np.float32([0.4, 0.5, 0.6]), np.float32([0.3, 0.4, 0.5])
    checkpoint = write_golden_variant(GOLDEN, tmp_path / "checkpoint", norm_mean=mean.tolist(), norm_std=std.tolist())
    case = "c_two_images"
    out = Preprocessor(checkpoint)(*golden_image_request(case))
    start = 0
    for i, (_, h, w) in enumerate(out.grid_thw.tolist()):
        official = golden_rows(golden[f"{case}/pixel_codes/{i}"], h, w).reshape(h * w, 3, -1) * 0.5 + 0.5  # x / 255
        expected = ((official - mean[:, None]) / std[:, None]).reshape(h * w, -1)
        np.testing.assert_allclose(out.pixel_values[start:start + h * w], expected, rtol=0, atol=1e-6)
        start += h * w


def test_minicpmv4_5_without_drop_vision_last_layer_is_refused(tmp_path):
    """The official config class drops the tower's last layer unless the config says not to; the
    tower here keeps every layer, so such a checkpoint is refused, naming the key."""
    import json

    from tests.minicpmv4_5_golden import GOLDEN
    from triton_vlm.families.minicpmv.tower_resampler import vision_settings

    config = json.loads((GOLDEN / "config.json").read_text())
    assert vision_settings(config)["depth"] == config["vision_config"]["num_hidden_layers"]
    for value in (True, None):
        changed = {k: v for k, v in config.items() if k != "drop_vision_last_layer"}
        if value is not None:
            changed["drop_vision_last_layer"] = value
        with pytest.raises(NotImplementedError, match="drop_vision_last_layer"):
            vision_settings(changed)


# ---- defaults: what a config leaves out, ours are its transformers class's -------------------------

def _plain(value):
    """Tuples as lists, all the way down (transformers keeps lists, preprocess tuples)."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


# What a text config of its `model_type` alone needs besides, where transformers' own defaults make
# no model it could run (GLM's default `mrope_section` covers half of its default head).
TEXT_KEPT = {name: {"rope_parameters": {"partial_rotary_factor": 0.5}} for name in ("glm4v", "glm46v", "glmga")}
TEXT_KEPT["glm4v_moe"] = {"head_dim": 128}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_text_config_of_its_model_type_alone_reads_as_its_class_fills_it(family, tmp_path):
    """Every text key left out (LLaVA-1.5's published `text_config` holds little more than its
    `model_type`): each value the decoder reads is the one transformers' class and rotary take."""
    import json

    from transformers import AutoConfig

    from triton_vlm.families.demo import write_demo_checkpoint
    from triton_vlm.llm import DecoderConfig

    checkpoint = write_demo_checkpoint(family, tmp_path / "writer", "tiny")
    rotary_class = type(Oracle(checkpoint).model.model.language_model.rotary_emb)
    config = json.loads((checkpoint / "config.json").read_text())
    config["text_config"] = {"model_type": config["text_config"]["model_type"], **TEXT_KEPT.get(family, {})}
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "generation_config.json").unlink()
    ours = DecoderConfig.from_checkpoint(checkpoint)
    text = AutoConfig.from_pretrained(checkpoint).get_text_config()
    rotary = rotary_class(config=text)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    # Qwen3.5-MoE's class has no dense MLP width: the shared expert's stands for it (`QWEN3_5_MOE`)
    intermediate = getattr(text, "intermediate_size", None) or text.shared_expert_intermediate_size
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers, ours.num_heads,
            ours.num_kv_heads, ours.head_dim, ours.rms_norm_eps, ours.max_position_embeddings) == (
        text.vocab_size, text.hidden_size, intermediate, text.num_hidden_layers, text.num_attention_heads,
        text.num_key_value_heads, head_dim, text.rms_norm_eps, text.max_position_embeddings)
    assert_rotary_is_transformers(ours, rotary, text)
    if len(ours.mrope_section) == 3:
        assert list(ours.mrope_section) == list(rotary.mrope_section)
    assert ours.layer_types == layer_types(ours, text)
    if ours.linear_attention:
        lin = ours.linear_attention
        assert (lin.num_k_heads, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim, lin.conv_kernel) == (
            text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
            text.linear_value_head_dim, text.linear_conv_kernel_dim)
    if ours.moe:
        assert (ours.moe.num_experts, ours.moe.num_experts_per_tok, ours.moe.moe_intermediate_size) == (
            getattr(text, "n_routed_experts", None) or text.num_experts, text.num_experts_per_tok,
            text.moe_intermediate_size)
    assert set(ours.eos_token_ids) == set(np.atleast_1d(config.get("eos_token_id") or []).tolist())


def test_every_vision_default_is_its_config_classs():
    """The towers' defaults (the keys they read where a vision config leaves them out) are those
    of transformers' vision config classes (the rotary theta in their `rope_parameters`)."""
    import transformers

    from triton_vlm.families.glm4v import tower as glm4v
    from triton_vlm.families.internvl import tower as internvl
    from triton_vlm.families.llava import onevision_tower as llava_onevision
    from triton_vlm.families.llava import tower as llava
    from triton_vlm.families.minicpmv import tower_v4_6 as minicpmv
    from triton_vlm.families.qwen2_5_vl import tower as qwen2_5_vl
    from triton_vlm.families.qwen3_vl import tower as qwen3_vl

    def same(ours: dict, hf) -> None:
        for key, value in ours.items():
            theirs = hf.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(hf, key)
            assert _plain(theirs) == _plain(value), (type(hf).__name__, key)

    same(qwen2_5_vl._DEFAULTS, transformers.Qwen2_5_VLVisionConfig())
    for hf in (transformers.Qwen3VLVisionConfig(), transformers.Qwen3VLMoeVisionConfig()):
        same(qwen3_vl._DEFAULTS, hf)
    for hf in (transformers.Qwen3_5VisionConfig(), transformers.Qwen3_5MoeVisionConfig()):
        assert not hasattr(hf, "deepstack_visual_indexes") and not qwen3_vl.QWEN3_5_DEFAULTS["deepstack_visual_indexes"]
        same({k: v for k, v in qwen3_vl.QWEN3_5_DEFAULTS.items() if k != "deepstack_visual_indexes"}, hf)
    for hf in (transformers.Glm4vVisionConfig(), transformers.Glm4vMoeVisionConfig()):
        same(glm4v._DEFAULTS, hf)
    same(glm4v._OCR_DEFAULTS, transformers.GlmOcrVisionConfig())
    for top in (transformers.MiniCPMV4_6Config(), transformers.MiniCPMV4_7Config(), transformers.MiniCPMOcrConfig()):
        same(minicpmv._VISION_DEFAULTS, top.vision_config)
        same(minicpmv._DEFAULTS, top)
    for name, kind in llava.TOWER_KINDS.items():
        same(kind.defaults, transformers.AutoConfig.for_model(name))
    for defaults, hf in ((llava.LLAVA_DEFAULTS, transformers.LlavaConfig()),
                         (llava_onevision.DEFAULTS, transformers.LlavaOnevisionConfig())):
        same({k: v for k, v in defaults.items() if k != "vision_model_type"}, hf)
        assert defaults["vision_model_type"] == hf.vision_config.model_type
    assert _plain(llava_onevision.DEFAULT_PINPOINTS) == transformers.LlavaOnevisionConfig().image_grid_pinpoints
    internvl_config = transformers.InternVLConfig()
    same({k: (v, v) if k in ("image_size", "patch_size") else v for k, v in internvl.VISION_DEFAULTS.items()},
         internvl_config.vision_config)
    same(internvl.INTERNVL_DEFAULTS, internvl_config)


# Each family's transformers image and video processor classes.
PROCESSOR_CLASSES = {
    "qwen2_5_vl": ("Qwen2VLImageProcessor", "Qwen2VLVideoProcessor"),
    **{name: ("Glm4vImageProcessor", "Glm4vVideoProcessor") for name in ("glm4v", "glm4v_moe")},
    **{name: ("Glm46VImageProcessor", "Glm46VVideoProcessor") for name in ("glm46v", "glm_ocr")},
    "glmga": ("GlmgaImageProcessor", "GlmgaVideoProcessor"),
    **{name: ("MiniCPMV4_6ImageProcessor", "MiniCPMV4_6VideoProcessor") for name in ("minicpmv4_6", "minicpmv4_7")},
    "minicpm_ocr": ("MiniCPMOcrImageProcessor", "MiniCPMOcrVideoProcessor"),
    "llava": ("CLIPImageProcessor", "SiglipImageProcessor"),
    "llava_onevision": ("LlavaOnevisionImageProcessor", "LlavaOnevisionVideoProcessor"),
    "internvl": ("GotOcr2ImageProcessor", "InternVLVideoProcessor"),
    **{name: ("Qwen2VLImageProcessor", "Qwen3VLVideoProcessor")
       for name in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")},
}
SETTINGS_READ = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "resample",
                 "scale_resolution", "max_slice_nums", "slice_mode", "downsample_mode", "use_image_id",
                 "small_image_upsize", "do_center_crop", "image_grid_pinpoints", "min_patches", "max_patches")


@pytest.mark.parametrize("family", list(PROCESSOR_CLASSES))
def test_every_processor_default_is_its_classs(family):
    """A processor config of its class's name alone: every setting preprocess reads is the value
    transformers' processor class takes (sizes as pixel budgets, edges or a square)."""
    import transformers

    from triton_vlm.preprocessing.request import vision_settings

    f = FAMILIES[family]
    for name, size_default in zip(PROCESSOR_CLASSES[family], (f.processor.image_size_default,
                                                               f.processor.video_size_default)):
        hf = getattr(transformers, name)()
        ours = vision_settings({"image_processor_type": name}, size_default, f.processor)
        for key in SETTINGS_READ:
            if getattr(hf, key, None) is not None:
                ours_value, theirs = _plain(getattr(ours, key)), _plain(getattr(hf, key))
                assert ours_value == (pytest.approx(theirs) if key in ("image_mean", "image_std") else theirs), (name, key)
        size = {k: getattr(getattr(hf, "size", None), k, None)
                for k in ("shortest_edge", "longest_edge", "height", "width")}
        if size["longest_edge"]:  # a pixel budget
            assert (ours.min_pixels, ours.max_pixels) == (size["shortest_edge"], size["longest_edge"]), name
        elif size["shortest_edge"]:  # an edge, then the centre crop
            crop = (hf.crop_size.height, hf.crop_size.width)
            assert (ours.shortest_edge, ours.crop_size) == (size["shortest_edge"], crop), name
        elif size["height"]:  # a square
            assert ours.resize_to == (size["height"], size["width"]), name
