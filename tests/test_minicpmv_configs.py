"""The remote-code MiniCPM-V versions' configs read as their official code reads them (issue #41):
keys left out take the official classes' defaults (`MiniCPMVConfig` on transformers 4.40's
`Qwen2Config` for 2.6 and 4.51's `LlamaConfig` for 4.0, `SiglipVisionConfig`,
`MiniCPMVImageProcessor`), where those differ from the golden values the served outputs move as the
official ones would, and 4.0's LongRoPE reads as transformers 4.51 reads it; every version's decoder
(4.5's too) reads its placeholders, terminators and weights as the official model runs. In process,
cheap."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.config_variants import write_golden_variant
from tests.minicpmv_golden import SETS
from triton_vlm.families import detect_family
from triton_vlm.llm import DecoderConfig
from triton_vlm.preprocessing.preprocessor import Preprocessor

REMOTE_CODE = ("minicpmv2_6", "minicpmv4_0")  # (2.5's processor numbers no images: its own tests below)


@pytest.mark.parametrize("family", sorted(SETS))
def test_the_decoder_reads_as_the_official_model_runs(family):
    """Placeholders the `<unk>` runs, stops the official `chat`'s terminators, 1-D RoPE; the
    language model's weights only (`vpm.*`, `resampler.*` are the tower's), the head its own."""
    from triton_vlm.llm.model import DecoderModel

    golden = SETS[family]
    config = DecoderConfig.from_checkpoint(golden.root)
    assert config.family == family
    assert config.placeholder_token_ids == (golden.special_id("<unk>"),)
    assert set(config.eos_token_ids) == set(golden.meta["generation"]["terminators"])
    assert config.mrope_section == (config.rotary_dim // 2,)
    model = DecoderModel.from_checkpoint(golden.root)
    official = json.loads((golden.root / "config.json").read_text())
    assert model.embed_tokens.shape == (official["vocab_size"], official["hidden_size"])
    assert len(model.layers) == official["num_hidden_layers"] and model.lm_head is not model.embed_tokens


@pytest.mark.parametrize("family", sorted(SETS))
def test_the_image_rows_sit_on_the_image_bound_runs(family):
    """In every golden case (4.5's video too) the `<unk>` tokens the decoder fills are exactly the
    official `image_bound` runs, each as long as `query_num`."""
    golden = SETS[family]
    unk, query_num = golden.special_id("<unk>"), json.loads((golden.root / "config.json").read_text())["query_num"]
    for case in golden.cases:
        ids, bound = golden.values[f"{case}/input_ids"], golden.values[f"{case}/image_bound"].reshape(-1, 2)
        runs = np.concatenate([np.arange(a, b) for a, b in bound] + [np.zeros(0, int)])
        np.testing.assert_array_equal(np.flatnonzero(ids == unk), runs, err_msg=case)
        assert golden.values[f"{case}/vision_embeds"].shape[:2] == (len(bound), query_num), case
        assert set(bound[:, 1] - bound[:, 0]) <= {query_num}, case


def respelled(family: str, tmp_path, config: dict | None = None, drop: tuple[str, ...] = (), **processor):
    """The golden checkpoint as `write_golden_variant` respells it, `config` keys set on top and
    `drop` left out."""
    out = write_golden_variant(SETS[family].root, tmp_path / "checkpoint", **processor)
    changed = {k: v for k, v in json.loads((out / "config.json").read_text()).items() if k not in drop}
    (out / "config.json").write_text(json.dumps(changed | (config or {})))
    return out


@pytest.mark.parametrize("family", REMOTE_CODE + ("minicpmv2_5", "minicpmv2_0"))
def test_keys_left_out_read_as_the_official_classes_default(family, tmp_path):
    """Without the keys whose official defaults are the golden values: the same decoder, tower and
    `preprocess` outputs (of the set's last image case: two images, or 2.0's wide one)."""
    golden = SETS[family]
    variant = respelled(family, tmp_path)
    assert DecoderConfig.from_checkpoint(variant) == DecoderConfig.from_checkpoint(golden.root)
    tower = detect_family(variant).tower_class()
    assert tower.read_vision_config(variant) == tower.read_vision_config(golden.root)
    case = golden.media_cases[-1]
    out = Preprocessor(variant)(*golden.request(case))
    np.testing.assert_array_equal(out.input_ids, golden.values[f"{case}/input_ids"])
    np.testing.assert_array_equal(out.grid_thw[:, 1:], golden.values[f"{case}/tgt_sizes"])


@pytest.mark.parametrize("family", REMOTE_CODE)
def test_without_use_image_id_images_are_not_numbered(family, tmp_path):
    """`MiniCPMVImageProcessor` numbers images only where its config says `use_image_id` (its
    default: false): left out, the golden ids lose their `<image_id>N</image_id>` runs."""
    golden = SETS[family]
    image = json.loads((golden.root / "preprocessor_config.json").read_text())
    variant = respelled(family, tmp_path)
    (variant / "preprocessor_config.json").write_text(json.dumps({k: v for k, v in image.items()
                                                                   if k != "use_image_id"}))
    ids = golden.values["c_two_images/input_ids"].tolist()
    expected, numbering = [], False
    for token in ids:  # all but `<image_id>` ... `</image_id>`
        numbering |= token == golden.special_id("<image_id>")
        expected += [token] * (not numbering)
        numbering &= token != golden.special_id("</image_id>")
    assert len(ids) - len(expected) >= 6  # two images, each numbered in 3 or more tokens
    assert Preprocessor(variant)(*golden.request("c_two_images")).input_ids.tolist() == expected


def test_a_siglip_config_missing_a_size_takes_siglips_default_not_the_so400m_one():
    """`MiniCPMVConfig` builds `SiglipVisionConfig(**vision_config)`: a size left out of a given
    vision config is SigLIP's class default (12 layers); with no vision config at all, the
    official `default_vision_config` (SoViT-400m, 27 layers)."""
    from triton_vlm.families.minicpmv.tower_resampler import vision_settings

    config = json.loads((SETS["minicpmv2_6"].root / "config.json").read_text())
    vision = {k: v for k, v in config["vision_config"].items() if k != "num_hidden_layers"}
    assert vision_settings({**config, "vision_config": vision})["depth"] == 12
    whole = vision_settings({k: v for k, v in config.items() if k != "vision_config"})
    assert (whole["depth"], whole["hidden_size"], whole["pos_embed_size"]) == (27, 1152, 70)


def test_qwen2_under_sdpa_ends_the_context_where_its_sliding_window_would_hide_a_key(tmp_path):
    """transformers 4.40's Qwen2 under SDPA (the official 2.6 code's attention) masks keys more than
    `sliding_window` back whatever `use_sliding_window` says: the golden 131072 is past the context,
    the class default 4096 (key left out) is not, and `head_dim` / `rope_scaling` are not read."""
    family = "minicpmv2_6"
    golden = DecoderConfig.from_checkpoint(SETS[family].root)
    assert golden.max_position_embeddings == 32768
    config = DecoderConfig.from_checkpoint(respelled(family, tmp_path, drop=("sliding_window",), config=dict(
        use_sliding_window=True, head_dim=16, rope_scaling={"rope_type": "longrope"})))
    assert config.max_position_embeddings == 4097
    assert (config.head_dim, config.longrope, config.rope_theta) == (golden.head_dim, None, golden.rope_theta)


def test_longrope_reads_as_transformers_4_51(tmp_path):
    """4.0's LongRoPE: its short factors turn the frequencies (the golden logits check them);
    `rope_scaling.original_max_position_embeddings` is not read, the top-level key is, making the
    factor max / original and the cos/sin scale sqrt(1 + ln(factor) / ln(original)); where the long
    factors differ from the short ones, positions end before they would apply."""
    family = "minicpmv4_0"
    golden = json.loads((SETS[family].root / "config.json").read_text())
    config = DecoderConfig.from_checkpoint(SETS[family].root)
    assert config.longrope.short_factor == tuple(golden["rope_scaling"]["short_factor"])
    assert (config.longrope.attention_factor, config.max_position_embeddings) == (1.0, 32768)
    assert golden["rope_scaling"]["original_max_position_embeddings"] != 32768
    config = DecoderConfig.from_checkpoint(respelled(family, tmp_path, config=dict(
        original_max_position_embeddings=8192)))
    assert config.longrope.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(8192)))
    assert config.max_position_embeddings == 32768  # short and long factors alike
    rope = dict(golden["rope_scaling"], long_factor=[2 * f for f in golden["rope_scaling"]["long_factor"]])
    config = DecoderConfig.from_checkpoint(respelled(family, tmp_path / "long", config=dict(
        original_max_position_embeddings=8192, rope_scaling=rope)))
    assert config.max_position_embeddings == 8192


@pytest.mark.parametrize("family, key", [("minicpmv2_6", "scale_emb"), ("minicpmv4_0", "scale_emb"),
                                         ("minicpmv4_0", "attention_bias"), ("minicpmv2_5", "attention_bias"),
                                         ("minicpmv2_5", "rope_scaling")])
def test_what_the_decoder_does_not_implement_is_refused_naming_it(family, key, tmp_path):
    """The official `get_vllm_embedding` scales the prompt's token embeddings by `scale_emb` but
    not the generated tokens'; Llama's biases; transformers 4.40's Llama `rope_scaling` (linear,
    dynamic): refused, naming the key."""
    with pytest.raises(NotImplementedError, match=key):
        DecoderConfig.from_checkpoint(respelled(family, tmp_path, config={key: 12}))


def test_an_empty_prompt_is_refused_though_the_tokenizer_puts_bos_before_it():
    from triton_vlm.errors import InvalidInput

    preprocessor = Preprocessor(SETS["minicpmv4_0"].root)
    with pytest.raises(InvalidInput, match="^text_input: the prompt is empty$"):
        preprocessor("", [], [])
    assert preprocessor("hi", [], []).input_ids[0] == SETS["minicpmv4_0"].special_id("<s>")


@pytest.mark.parametrize("family", REMOTE_CODE + ("minicpmv2_5",))
def test_versions_without_videos_read_a_video_marker_as_text_and_refuse_videos(family):
    """2.6's and 4.0's processors take images only: `(<video>./</video>)` is text to them."""
    from triton_vlm.errors import InvalidInput

    preprocessor = Preprocessor(SETS[family].root)
    text = "(<video>./</video>) what moves?"
    assert len(preprocessor(text, [], []).input_ids) > 8
    with pytest.raises(InvalidInput, match=f"^videos: this model \\({family}\\) takes no videos"):
        preprocessor(text, [], [b"\x00\x00\x00\x18ftypmp42"])


def test_the_official_2_5_config_as_published_is_2_5():
    """The official 2.5 `config.json` (the golden one: the publisher's with only sizes and ids
    changed, `version` 2.5) serves as 2.5; its tokenizer puts a second `<|begin_of_text|>` after the
    template's, as the official processor's does."""
    golden = SETS["minicpmv2_5"]
    assert json.loads((golden.root / "config.json").read_text())["version"] == "2.5"
    assert detect_family(golden.root).name == "minicpmv2_5"
    ids = Preprocessor(golden.root)(*golden.request("d_text_only")).input_ids
    np.testing.assert_array_equal(ids, golden.values["d_text_only/input_ids"])
    assert ids[:2].tolist() == [golden.special_id("<|begin_of_text|>")] * 2


def test_2_5_without_its_batched_vision_call_is_refused_naming_it():
    """2.5's official code pads a request's slices to the largest only in its batched `vpm` call
    (`batch_vision_input`, true by default, as configured); false is refused, naming the key."""
    golden = SETS["minicpmv2_5"]
    config = json.loads((golden.root / "config.json").read_text())
    tower = detect_family(golden.root).tower_class()
    assert tower.checkpoint_settings({k: v for k, v in config.items() if k != "batch_vision_input"}) \
        == tower.read_vision_config(golden.root)
    with pytest.raises(NotImplementedError, match="batch_vision_input false"):
        tower.checkpoint_settings({**config, "batch_vision_input": False})
