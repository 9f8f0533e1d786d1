"""`preprocess` of MiniCPM-V 4.5 images against the official processor's golden values
(`tests/golden/minicpmv4_5/`): the JPEGs as a client sends them and the golden prompt give the
golden `input_ids` (placeholders expanded to `<image_id>`, `<image>` and `<slice>` runs of
`query_num` `<unk>`), `tgt_sizes` and pixel values, bit for bit."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.minicpmv4_5_golden import CASES, GOLDEN, IMAGE_CASES
from triton_vlm.preprocess import Preprocessor



@pytest.fixture(scope="module")
def preprocessor():
    return Preprocessor(GOLDEN)


def golden_rows(codes: np.ndarray, h: int, w: int) -> np.ndarray:
    """The README's pixel encoding ([3, 14, 14 * P] codes in `reshape_by_patch` layout) as our rows:
    [P, 3 * 14 * 14], patch k's pixels in (channel, dy, dx) order."""
    pixels = ((codes.astype(np.float32) / 255) - 0.5) / 0.5
    return pixels.reshape(3, 14, h * w, 14).transpose(2, 0, 1, 3).reshape(h * w, -1)


@pytest.mark.parametrize("case", IMAGE_CASES)
def test_images_are_the_official_processors_to_the_bit(preprocessor, golden, case):
    c = CASES[case]
    out = preprocessor(c["prompt"], [(GOLDEN / m["file"]).read_bytes() for m in c["media"]], [])
    assert np.array_equal(out.input_ids, golden[f"{case}/input_ids"])
    assert np.array_equal(out.grid_thw[:, 1:], golden[f"{case}/tgt_sizes"].reshape(-1, 2))
    assert (out.grid_thw[:, 0] == 1).all()
    start = 0
    for i, (_, h, w) in enumerate(out.grid_thw.tolist()):
        assert np.array_equal(out.pixel_values[start:start + h * w], golden_rows(golden[f"{case}/pixel_codes/{i}"], h, w)), i
        start += h * w
    assert start == len(out.pixel_values)
    n = len(out.input_ids)  # the official model numbers the tokens 0..S-1
    assert np.array_equal(out.mrope_position_ids, np.broadcast_to(np.arange(n), (3, n)))
    assert int(out.mrope_position_delta) == 0


def test_the_expanded_prompt_reads_as_the_official_one(preprocessor):
    """The text of the ids: `<image_id>0</image_id><image><unk>...</image><slice>...</slice>`."""
    from tokenizers import Tokenizer

    case = CASES["a_image_640x480"]
    out = preprocessor(case["prompt"], [(GOLDEN / case["media"][0]["file"]).read_bytes()], [])
    tokenizer = Tokenizer.from_file(str(GOLDEN / "tokenizer.json"))
    assert tokenizer.decode(out.input_ids.tolist(), skip_special_tokens=False) == case["expanded_prompt"]


@pytest.mark.parametrize("text, images, message", [
    ("(<image>./</image>)(<image>./</image>) two", 1, "2 image placeholders but 1 images given"),
    ("<image>./</image> no parentheses", 1, None),  # no placeholder: one is put before the text
])
def test_placeholders_are_found_in_the_text(preprocessor, golden, text, images, message):
    image = (GOLDEN / CASES["c_two_images"]["media"][1]["file"]).read_bytes()
    if message:
        from triton_vlm.errors import InvalidInput

        with pytest.raises(InvalidInput, match=message):
            preprocessor(text, [image] * images, [])
        return
    out = preprocessor(text, [image] * images, [])
    assert len(out.grid_thw) == 1
    unk = json.loads((GOLDEN / "cases.json").read_text())["tokenizer"]["special_ids"]["<unk>"]
    assert int((out.input_ids == unk).sum()) == json.loads((GOLDEN / "config.json").read_text())["query_num"]


def test_a_video_is_refused_naming_the_input(preprocessor):
    """Videos (packed frames resampled together with their temporal ids) are not served yet: a
    request with one is refused, rather than encoded otherwise than the official code does."""
    from triton_vlm.errors import InvalidInput

    video = (GOLDEN / CASES["d_video"]["media"][0]["file"]).read_bytes()
    with pytest.raises(InvalidInput, match=r"^videos: this model \(minicpmv4_5\) takes no videos"):
        preprocessor("(<video>./</video>)\nDescribe the video.", [], [video])
