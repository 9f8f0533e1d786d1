"""MiniCPM-OCR `preprocess` against transformers, computed in the same run.

Oracles: `MiniCPMOcrProcessor` of the tiny demo checkpoint (its image processor with
`small_image_upsize` "adaptive", `downsample_mode` "4x") for `input_ids`, `pixel_values` and the
target sizes, mapped to the contract as in `tests/test_preprocess_minicpmv.py`;
`adaptive_upsize_resolution` for the glyph analysis; the positions the model's text stack gets
(plain, as 4.6's). Documents are `samples.document_bytes` pages: small dense print where the page
has text, blank elsewhere, so that slices of one page take different sizes.
"""
from __future__ import annotations

import io
import json
import shutil
from functools import cache

import numpy as np
import pytest

from tests.oracle import Oracle
from tests.test_preprocess_minicpmv import IMG, VID, chat, check_against_hf, image, model_positions, video
from triton_vlm.errors import InvalidInput
from triton_vlm.families.minicpmv.ocr import glyph_resolution
from triton_vlm.media import samples
from triton_vlm.preprocessing.preprocessor import Preprocessor


@cache
def document(width: int, height: int, text_box=None, dark: bool = False, fmt: str = "PNG") -> bytes:
    return samples.document_bytes(width, height, text_box, dark=dark, seed=width + height, fmt=fmt)


DOCUMENTS = {
    "page of print": document(100, 90),
    "dark page": document(100, 90, dark=True),
    "half printed": document(200, 150, (0, 0, 100, 150)),
    "printed corner": document(230, 170, (0, 0, 80, 60)),
    "wide strip": document(400, 90, (0, 0, 150, 90)),
    "blank page": document(210, 140, (0, 0, 1, 1)),
    "jpeg page": document(230, 170, (0, 0, 80, 60), fmt="JPEG"),
    "large page": document(640, 480),
    "tiny photo": image(60, 80),
    "photo": image(640, 480),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from triton_vlm.families.demo import write_demo_checkpoint

    return write_demo_checkpoint("minicpm_ocr", tmp_path_factory.mktemp("minicpm_ocr-tiny"), "tiny")


@pytest.fixture(scope="module")
def ocr(ckpt) -> tuple[Preprocessor, Oracle]:
    return Preprocessor(ckpt), Oracle(ckpt)


@pytest.mark.parametrize("name", list(DOCUMENTS))
@pytest.mark.parametrize("scale", [112, 448])
def test_glyph_resolution_equals_transformers(name, scale):
    from PIL import Image
    from transformers.models.minicpm_ocr.image_processing_minicpm_ocr import adaptive_upsize_resolution

    pixels = np.asarray(Image.open(io.BytesIO(DOCUMENTS[name])).convert("RGB"))
    expected = adaptive_upsize_resolution(np.ascontiguousarray(pixels.transpose(2, 0, 1)), scale)
    assert glyph_resolution(pixels, scale, name) == expected


@pytest.mark.parametrize("name", list(DOCUMENTS))
def test_image_matches_transformers(ocr, name):
    pre, hf = ocr
    ours, out = check_against_hf(pre, hf, chat(IMG + "Read the page."), [DOCUMENTS[name]])
    if name == "half printed":  # the model runs once: plain positions, as 4.6's
        np.testing.assert_array_equal(ours.mrope_position_ids, model_positions(hf, out))
    assert ours.mrope_position_delta == 0


def test_adaptive_slices_differ_in_size(ocr):
    """A page printed on its left half only: the blank slices are read smaller than the printed ones."""
    pre, _ = ocr
    sizes = {tuple(g) for g in pre(chat(IMG), [DOCUMENTS["half printed"]]).grid_thw[1:].tolist()}
    assert len(sizes) > 1


def test_several_images_and_video_match_transformers(ocr):
    pre, hf = ocr
    text = chat(IMG + "and" + VID + "then" + IMG + IMG)
    images = [DOCUMENTS["printed corner"], DOCUMENTS["photo"], DOCUMENTS["wide strip"]]
    ours, out = check_against_hf(pre, hf, text, images, [video(2, 4, 320, 240)])
    np.testing.assert_array_equal(ours.mrope_position_ids, model_positions(hf, out))


@pytest.mark.parametrize("mode", ["always", "never"])
def test_small_image_upsize_settings_match_transformers(ckpt, tmp_path, mode):
    changed = shutil.copytree(ckpt, tmp_path / "ckpt")
    config = json.loads((changed / "processor_config.json").read_text())
    config["image_processor"]["small_image_upsize"] = mode
    (changed / "processor_config.json").write_text(json.dumps(config))
    pre, hf = Preprocessor(changed), Oracle(changed)
    names = ["page of print", "half printed", "tiny photo", "photo"]
    check_against_hf(pre, hf, chat(" ".join([IMG] * len(names))), [DOCUMENTS[n] for n in names])


def test_image_it_cannot_read_fails_by_name(ocr):
    pre, _ = ocr
    with pytest.raises(InvalidInput, match=r"images\[1\]: aspect ratio .* exceeds max_aspect_ratio=200"):
        pre(chat(IMG + IMG), [DOCUMENTS["photo"], document(4020, 18)])
