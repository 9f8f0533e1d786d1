"""Gemma 3's `preprocess` against transformers' `Gemma3Processor` (`Gemma3ImageProcessor`, torchvision
backend) on the tiny demo checkpoint: `input_ids` (`<bos>`, each `<start_of_image>` expanded with
`\\n\\n` around its run and the text tokenized whole), `pixel_values` bit for bit (as rows:
`patch_rows` of the processor's [B, 3, H, W]) and one grid row per view, for images of several
sizes and aspects, two images, text alone, with and without pan-and-scan (`mm_options`, a boolean
as transformers' keyword; the processor turns it off whatever its config says). Videos, a
non-boolean `do_pan_and_scan` and the option on another family are refused naming them.
"""
from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from tests.oracle import Oracle
from triton_vlm.errors import InvalidInput
from triton_vlm.families.gemma3.processor import BOI
from triton_vlm.media import samples

SIZES = [(640, 480), (200, 100), (112, 112), (60, 300), (1920, 1080), (31, 17)]
# (width, height) long enough for pan-and-scan crops: 3 across, 2 down, 4 across; then none (too short)
PAN_SIZES = [(900, 300), (300, 700), (1600, 300), (500, 300)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from triton_vlm.families.demo import write_demo_checkpoint

    return write_demo_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"), "tiny")


@pytest.fixture(scope="module")
def case(checkpoint):
    from triton_vlm.preprocessing.preprocessor import Preprocessor

    return Preprocessor(checkpoint), Oracle(checkpoint)


def chat(text: str) -> str:
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


def image(width: int, height: int, seed: float = 0.0) -> bytes:
    return samples.image_bytes(width, height, seed=seed)


def check(pre, oracle: Oracle, prompt: str, images: list[bytes], pan_and_scan: bool | None = None) -> None:
    from triton_vlm.families.llava.tower import patch_rows

    options = None if pan_and_scan is None else {"do_pan_and_scan": pan_and_scan}
    out = pre(prompt, images, mm_options=options)
    kwargs = {} if pan_and_scan is None else {"do_pan_and_scan": pan_and_scan}
    if images:
        inputs = oracle.inputs(prompt, images) if not kwargs else _inputs(oracle, prompt, images, kwargs)
    else:
        inputs = oracle.processor(text=[prompt], return_tensors="pt")
    np.testing.assert_array_equal(out.input_ids, inputs["input_ids"][0].numpy())
    p = 14
    if images:
        pixels = inputs["pixel_values"].numpy()
        np.testing.assert_array_equal(out.grid_thw, [[1, 8, 8]] * pixels.shape[0])
        assert out.pixel_values.dtype == np.float32
        np.testing.assert_array_equal(out.pixel_values, patch_rows(pixels, p))
    else:
        assert out.grid_thw.shape == (0, 3) and out.pixel_values.shape[0] == 0
    n = out.input_ids.shape[0]
    np.testing.assert_array_equal(out.mrope_position_ids, np.broadcast_to(np.arange(n), (3, n)))
    assert out.mrope_position_delta == 0


def _inputs(oracle: Oracle, prompt: str, images: list[bytes], kwargs: dict) -> dict:
    import io

    from PIL import Image

    return oracle.processor(text=[prompt], images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images],
                            return_tensors="pt", **kwargs)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_image_matches_gemma3_processor(case, size):
    pre, oracle = case
    check(pre, oracle, chat(BOI + " What is this?"), [image(*size)])


@pytest.mark.parametrize("size", PAN_SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_pan_and_scan_matches_gemma3_processor(case, size):
    pre, oracle = case
    check(pre, oracle, chat("Look: " + BOI + "what is this?"), [image(*size)], pan_and_scan=True)
    check(pre, oracle, chat("Look: " + BOI + "what is this?"), [image(*size)], pan_and_scan=False)


def test_two_images_and_no_placeholder(case):
    pre, oracle = case
    images = [image(640, 480, 1.0), image(900, 300, 2.0)]
    check(pre, oracle, chat(f"{BOI} and\n{BOI} which?"), images)
    check(pre, oracle, chat(f"{BOI} and\n{BOI} which?"), images, pan_and_scan=True)
    out = pre(chat("Which?"), images[:1])  # no placeholder: put before the text, as the one-image default
    assert out.input_ids[0] == pre.tokenizer.token_to_id("<bos>")
    assert int((out.input_ids == pre.tokenizer.token_to_id("<image_soft_token>")).sum()) == 16


def test_text_only_prompt(case):
    pre, oracle = case
    check(pre, oracle, chat("Tell me about a red car."), [])


def test_saved_pan_and_scan_is_overridden_by_the_processor(checkpoint, tmp_path):
    """`Gemma3Processor` turns pan-and-scan off whatever the saved image processor config says."""
    from triton_vlm.preprocessing.preprocessor import Preprocessor

    copy = shutil.copytree(checkpoint, tmp_path / "ckpt")
    config = json.loads((copy / "processor_config.json").read_text())
    config["image_processor"].update(do_pan_and_scan=True, pan_and_scan_min_crop_size=10)
    (copy / "processor_config.json").write_text(json.dumps(config))
    check(Preprocessor(copy), Oracle(copy), chat(BOI), [image(900, 300)])


def test_refusals_name_the_input(case, tmp_path):
    pre, _ = case
    with pytest.raises(InvalidInput, match=r"videos: this model \(gemma3\) takes no videos"):
        pre(chat(BOI), [image(64, 64)], [samples.video_bytes(seconds=1.0, fps=4, width=64, height=64)])
    with pytest.raises(InvalidInput, match="mm_options: do_pan_and_scan must be a boolean"):
        pre(chat(BOI), [image(64, 64)], mm_options={"do_pan_and_scan": 1})
    with pytest.raises(InvalidInput, match="min_pixels does not apply: gemma3 sizes images by the checkpoint's size"):
        pre(chat(BOI), [image(64, 64)], mm_options={"min_pixels": 1000})


def test_pan_and_scan_is_refused_by_other_families(tmp_path):
    from triton_vlm.families.demo import write_demo_checkpoint
    from triton_vlm.preprocessing.preprocessor import Preprocessor

    pre = Preprocessor(write_demo_checkpoint("llava", tmp_path / "llava", "tiny"))
    with pytest.raises(InvalidInput, match="mm_options: do_pan_and_scan does not apply: llava's processor has no "
                                           "do_pan_and_scan"):
        pre("<image>", [image(64, 64)], mm_options={"do_pan_and_scan": True})
