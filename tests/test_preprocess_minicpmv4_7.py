"""MiniCPM-V 4.7 `preprocess` against transformers, computed in the same run.

Oracles: `MiniCPMV4_7Processor` of the tiny demo checkpoint for `input_ids`, `pixel_values` and the
target sizes (`grid_thw`), mapped to the contract as in `tests/test_preprocess_minicpmv.py`; for
the positions and the delta, `MiniCPMV4_7Model.get_rope_index` on the processor's `input_ids`,
`mm_token_type_ids` and target sizes, and (once per kind of prompt) the position ids the model's
text stack gets while `generate` runs.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tests.oracle import Oracle
from tests.test_preprocess_minicpmv import IMG, VID, chat, check_against_hf, image, video
from triton_vlm.families.minicpmv.canvas_mrope import crop_positions
from triton_vlm.preprocessing.preprocessor import Preprocessor

SIZES = [(448, 448), (640, 480), (1920, 1080), (4000, 1000), (200, 100)]
PROMPTS = {
    "several images": (chat(IMG + "and" + IMG + " " + IMG + "?"), [image(640, 480), image(448, 448), image(200, 100)],
                       []),
    "video": (chat(VID + "What moves?"), [], [video(2, 4, 320, 240)]),
    "two videos": (chat(VID + "What moves?" + VID), [], [video(3.5, 4), video(2, 5, 320, 240)]),
    "mix": (chat(IMG + "and" + VID + "then" + IMG + "\n" + VID), [image(640, 480), image(20, 90, "PNG")],
            [video(2, 4), video(3, 5, 320, 200)]),
    # a video right after a picture's last slice: one canvas group (only markers between them)
    "image against video": (chat(IMG + VID), [image(1920, 1080)], [video(2, 4, 320, 240)]),
    "video against image": (chat(VID + IMG + "which?"), [image(1920, 1080)], [video(2, 4, 320, 240)]),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from triton_vlm.families.demo import write_demo_checkpoint

    return write_demo_checkpoint("minicpmv4_7", tmp_path_factory.mktemp("minicpmv4_7-tiny"), "tiny")


@pytest.fixture(scope="module")
def mc(ckpt) -> tuple[Preprocessor, Oracle]:
    return Preprocessor(ckpt), Oracle(ckpt)


def rope_index(hf: Oracle, out) -> tuple[np.ndarray, int]:
    positions, deltas = hf.model.model.get_rope_index(
        out["input_ids"], out["mm_token_type_ids"], target_sizes=out.get("target_sizes"),
        target_sizes_videos=out.get("target_sizes_videos"))
    return positions[:, 0].numpy(), int(deltas[0, 0])


@torch.no_grad()
def generate_positions(hf: Oracle, out) -> np.ndarray:
    """The [T, H, W] rotary positions the text stack gets on `generate`'s first step."""
    captured = []
    rotary = hf.model.model.language_model.rotary_emb
    handle = rotary.register_forward_pre_hook(lambda _module, args: captured.append(args[1].clone()))
    try:
        hf.model.generate(**out, max_new_tokens=1, do_sample=False)
    finally:
        handle.remove()
    return captured[0][-3:, 0].numpy()


def check(pre: Preprocessor, hf: Oracle, text: str, images=(), videos=(), run_model: bool = False):
    ours, out = check_against_hf(pre, hf, text, images, videos)
    positions, delta = rope_index(hf, out)
    np.testing.assert_array_equal(ours.mrope_position_ids, positions)
    assert ours.mrope_position_delta == delta
    if run_model:
        np.testing.assert_array_equal(ours.mrope_position_ids, generate_positions(hf, out))
    return ours


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_image_matches_transformers(mc, size):
    pre, hf = mc
    ours = check(pre, hf, chat(IMG + "What is this?"), [image(*size)], run_model=size == (1920, 1080))
    assert ours.mrope_position_delta < 0  # a canvas takes fewer positions than its tokens


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prompt_matches_transformers(mc, name):
    pre, hf = mc
    check(pre, hf, *PROMPTS[name], run_model=name in ("video", "mix"))


def test_text_only_positions_are_plain(mc):
    pre, hf = mc
    text = chat("Tell me about a red car.")
    ours = pre(text)
    np.testing.assert_array_equal(ours.mrope_position_ids, np.tile(np.arange(len(ours.input_ids)), (3, 1)))
    assert ours.mrope_position_delta == 0


def test_videos_carry_no_image_id(mc):
    """4.7 numbers images only (`_prepend_local_ids` skips videos), unlike 4.6."""
    pre, _ = mc
    ids = pre(chat(IMG + VID + VID), [image(64, 64)], [video(2, 4), video(2, 4)]).input_ids.tolist()
    assert ids.count(pre.tokenizer.token_to_id("<image_id>")) == 1


@pytest.mark.parametrize("settings", [dict(downsample_mode="4x"), dict(slice_mode=False), dict(use_image_id=False)],
                         ids=["4x", "no-slices", "no-image-id"])
def test_processor_settings_match_transformers(ckpt, tmp_path, settings):
    """Changed token counts (4x: the model's mode too, as `get_rope_index` divides by it), no
    slices (a canvas of the overview alone), no image ids."""
    changed = shutil.copytree(ckpt, tmp_path / "ckpt")
    config = json.loads((changed / "processor_config.json").read_text())
    for section in ("image_processor", "video_processor"):
        config[section].update(settings)
    (changed / "processor_config.json").write_text(json.dumps(config))
    if "downsample_mode" in settings:
        model_config = json.loads((changed / "config.json").read_text())
        (changed / "config.json").write_text(json.dumps({**model_config, **settings}))
    pre, hf = Preprocessor(changed), Oracle(changed)
    check(pre, hf, chat(IMG + "and" + VID), [image(1920, 1080)], [video(2, 4, 320, 240)])


@pytest.mark.parametrize("canvas,n", [(7, 3), (13, 7), (8, 8), (29, 4), (5, 1), (101, 12)])
def test_stretch_rounds_as_torch_linspace(canvas, n):
    """Overview positions over a wider canvas: `torch.linspace(0, canvas - 1, n).round()`."""
    from transformers.models.minicpmv4_7.modeling_minicpmv4_7 import MiniCPMV4_7Model

    ref = MiniCPMV4_7Model.get_vision_position_ids(None, 10, [n * 4, 2 * 4], canvas, 3, spatial_merge_size=4)
    np.testing.assert_array_equal(crop_positions(10, (n * 4, 8), 4, (canvas, 3)), ref.numpy())


def test_checkpoint_without_markers_is_refused(ckpt, tmp_path):
    changed = shutil.copytree(ckpt, tmp_path / "ckpt")
    config = json.loads((changed / "config.json").read_text())
    del config["newline_id"]
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="newline_id"):
        Preprocessor(changed).warmup()


def random_prompt(rng: np.random.Generator, markers: dict, tokens: dict, merge: int):
    """(input_ids, kinds, crop sizes in prompt order) of a random prompt in the processor's layout:
    text runs (possibly empty, so items sit against each other) between images and videos of 1 to 3
    frames, each frame `<image>` + overview + `</image>` then maybe a grid of `<slice>` runs, rows
    joined by a newline; crop sides random multiples of `merge`. Sizes come with each crop's kind."""
    ids, kinds, sizes, crop_kinds = [], [], [], []

    def text(n):
        ids.extend(rng.integers(20, 200, n).tolist())
        kinds.extend([0] * n)

    def crop(kind, token):
        h, w = (int(v) * merge for v in rng.integers(1, 5, 2))
        sizes.append((h, w))
        crop_kinds.append(kind)
        ids.extend([token] * (h * w // merge ** 2))
        kinds.extend([kind] * (h * w // merge ** 2))

    def marker(name):
        ids.append(markers[name])
        kinds.append(0)

    text(int(rng.integers(0, 4)))
    for _ in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(1, 3))
        for _ in range(int(rng.integers(1, 4)) if kind == 2 else 1):
            marker("image_start_id")
            crop(kind, tokens[kind])
            marker("image_end_id")
            rows, cols = (int(v) for v in rng.integers(0, 3, 2)) if rng.random() < 0.6 else (0, 0)
            for r in range(rows if cols else 0):
                if r:
                    marker("newline_id")
                for _ in range(cols):
                    marker("slice_start_id")
                    crop(kind, tokens[kind])
                    marker("slice_end_id")
        text(int(rng.integers(0, 3)))
    return np.array(ids), np.array(kinds), np.array(sizes), np.array(crop_kinds)


@pytest.mark.parametrize("mode", ["16x", "4x"])
def test_canvas_positions_equal_get_rope_index_on_random_layouts(mc, mode):
    """Prompts the processor would rarely give (items against each other, one-slice rows, frames
    without slices among sliced ones, crops of any size): `canvas_positions` equals the model's
    `get_rope_index` position for position, and the delta."""
    from triton_vlm.families.minicpmv.canvas_mrope import canvas_positions
    from triton_vlm.families.minicpmv.v4_7 import markers

    _, hf = mc
    config = hf.model.config
    names = ("image_start_id", "image_end_id", "slice_start_id", "slice_end_id", "newline_id")
    marker_ids = {name: getattr(config, name) for name in names}
    merge = 2 if mode == "4x" else 4
    rng = np.random.default_rng(7)
    for _ in range(150):
        ids, kinds, sizes, crop_kinds = random_prompt(rng, marker_ids, {1: config.image_token_id,
                                                                         2: config.video_token_id}, merge)
        ref, delta = hf.model.model.get_rope_index(
            torch.from_numpy(ids)[None], torch.from_numpy(kinds)[None],
            target_sizes=torch.from_numpy(sizes[crop_kinds == 1]),
            target_sizes_videos=torch.from_numpy(sizes[crop_kinds == 2]), downsample_mode=mode)
        ours, our_delta = canvas_positions(ids, kinds, sizes, markers(config.to_dict()), merge)
        np.testing.assert_array_equal(ours, ref[:, 0].numpy())
        assert our_delta == int(delta[0, 0])
