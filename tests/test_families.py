"""`detect_family`: the family is read from the checkpoint's own configs, never from a typed name.

Released GLM-4.6V-Flash and GLMGA checkpoints may say `model_type: glm4v`; their video processor
class tells the variants apart, in the v5 nested `processor_config.json` and in the older separate
`video_preprocessor_config.json` alike.
"""
from __future__ import annotations

import json

import pytest

from triton_vlm.families import FAMILIES, detect_family
from triton_vlm.families.demo import write_demo_checkpoint


@pytest.fixture(scope="module")
def glm_checkpoints(tmp_path_factory):
    return {v: write_demo_checkpoint(v, tmp_path_factory.mktemp(v), "tiny")
            for v in ("glm4v", "glm46v", "glmga", "glm_ocr", "glm4v_moe")}


def _set_model_type(checkpoint, model_type: str) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["model_type"] = model_type
    (checkpoint / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("variant", ["glm4v", "glm46v", "glmga"])
def test_glm_variant_from_video_processor_when_model_type_says_glm4v(glm_checkpoints, variant, tmp_path):
    import shutil

    checkpoint = shutil.copytree(glm_checkpoints[variant], tmp_path / "ckpt")
    _set_model_type(checkpoint, "glm4v")
    assert detect_family(checkpoint).name == variant

    # the older layout: the video processor in its own file
    processor = json.loads((checkpoint / "processor_config.json").read_text())
    (checkpoint / "video_preprocessor_config.json").write_text(json.dumps(processor.pop("video_processor")))
    (checkpoint / "processor_config.json").write_text(json.dumps(processor))
    assert detect_family(checkpoint).name == variant


def test_glm4v_model_type_without_a_video_processor_is_glm4v(glm_checkpoints, tmp_path):
    import shutil

    checkpoint = shutil.copytree(glm_checkpoints["glm46v"], tmp_path / "ckpt")
    _set_model_type(checkpoint, "glm4v")
    processor = json.loads((checkpoint / "processor_config.json").read_text())
    processor.pop("video_processor")
    (checkpoint / "processor_config.json").write_text(json.dumps(processor))
    assert detect_family(checkpoint).name == "glm4v"


def test_every_family_detects_its_own_model_type(glm_checkpoints):
    for variant, checkpoint in glm_checkpoints.items():
        assert detect_family(checkpoint) is FAMILIES[variant]


def test_the_family_names_its_tower_decoder_and_demo():
    """One registry: each family names its tower class and decoder spec; each has a demo checkpoint."""
    from triton_vlm.families.demo import Demo
    from triton_vlm.llm.layers.spec import DecoderSpec
    from triton_vlm.vision.tower.base import Tower

    for family in FAMILIES.values():
        by_text_model = family.decoder if not isinstance(family.decoder, str) else {"": family.decoder}
        specs = [family.decoder_spec(t) for t in by_text_model]
        assert issubclass(family.tower_class(), Tower) and all(isinstance(s, DecoderSpec) for s in specs)
        assert isinstance(family.demo_spec(), Demo) and {"tiny", "small"} <= set(family.demo_spec().sizes)


def test_unsupported_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "paligemma"}))
    with pytest.raises(ValueError, match="model_type 'paligemma' is not supported; supported: qwen2_5_vl, qwen2_vl, glm4v"):
        detect_family(tmp_path)


@pytest.mark.parametrize("config, family", [
    ({"version": 2.6}, "minicpmv2_6"), ({"version": 4.0}, "minicpmv4_0"), ({"version": 4.5}, "minicpmv4_5"),
    ({"version": 2.5}, "minicpmv2_5"),
    ({"hidden_size": 2304, "query_num": 64}, "minicpmv2_0"),  # no version: the real 2.0 (vLLM's test)
    ({"vision_encoder": "vit_so400m_patch14_siglip_384.webli", "scale_emb": 12}, "minicpmv2_0")])  # 2.0's keys
def test_minicpmv_versions_are_dispatched_by_the_configs_version(tmp_path, config, family):
    """`minicpmv` spans the official `MiniCPMV`'s versions: each served one is its own family."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "minicpmv", **config}))
    assert detect_family(tmp_path).name == family


@pytest.mark.parametrize("config, version", [
    ({"version": 4}, "4"),
    ({}, r"\(none, and not 2.0's config\)"), ({"scale_emb": 12}, r"\(none, and not 2.0's config\)")])
def test_a_minicpmv_version_not_served_is_refused_at_build_naming_it(tmp_path, config, version):
    from triton_vlm.repository.build import build_repository

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "minicpmv", **config}))
    message = f"minicpmv version {version} is not supported; supported versions: 2.0, 2.5, 2.6, 4.0, 4.5$"
    with pytest.raises(ValueError, match=message):
        build_repository(checkpoint, tmp_path / "repository")
    assert not (tmp_path / "repository").exists()


def test_demo_checkpoint_overrides(tmp_path):
    """Size overrides (bench/decoder.py --decoder-7b writes through them): text sizes key by key, a
    model vocabulary past the tokenizer's, bfloat16 weights; our decoder and transformers read it."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from triton_vlm.llm import DecoderConfig

    ckpt = write_demo_checkpoint("qwen2_5_vl", tmp_path, "tiny", overrides={
        "text": {"num_hidden_layers": 1}, "model_vocab_size": 1536, "dtype": "bfloat16"})
    config = DecoderConfig.from_checkpoint(ckpt)
    assert (config.num_layers, config.vocab_size, config.hidden_size, config.mrope_section) == (1, 1536, 64, (2, 3, 3))
    assert len(json.loads((ckpt / "tokenizer.json").read_text())["model"]["vocab"]) <= 1024
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert AutoModelForImageTextToText.from_pretrained(ckpt).lm_head.weight.shape == (1536, 64)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen2_vl_and_qwen2_5_vl_are_told_apart_by_model_type(tmp_path, model_type):
    """The two share a folder, a processor class and a video processor class: `model_type` alone
    picks the family."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"video_processor": {"video_processor_type": "Qwen2VLVideoProcessor"}}))
    assert detect_family(tmp_path).name == model_type


def test_a_qwen2_vl_tower_config_not_implemented_is_refused_naming_the_key():
    """transformers' Qwen2-VL tower takes axial rotary only; so does ours, naming the key."""
    tower = FAMILIES["qwen2_vl"].tower_class()
    assert tower.vision_settings({"embed_dim": 64, "num_heads": 4})["head_dim"] == 16
    with pytest.raises(ValueError, match="vision_config.rope_parameters.rope_type 'default' is not supported"):
        tower.vision_settings({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
