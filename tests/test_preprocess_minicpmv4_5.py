"""`preprocess` of MiniCPM-V 4.5 against the official processor's golden values
(`tests/golden/minicpmv4_5/`), in process: the expanded prompt's text, placeholders found in the
text, and videos as the official "chat with video" makes them (the images' ids, `tgt_sizes` and
pixels are checked through the server: `tests/test_e2e_minicpmv4_5.py`)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.minicpmv4_5_golden import CASES, GOLDEN
from tests.minicpmv_golden import golden_rows
from triton_vlm.preprocessing.preprocessor import Preprocessor


@pytest.fixture(scope="module")
def preprocessor():
    return Preprocessor(GOLDEN)


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


VIDEO = CASES["d_video"]
PACKED = {"force_packing": VIDEO["video"]["force_packing"]}


def video_prompt() -> str:
    """The golden prompt as a client writes it: one `(<video>./</video>)` marker where the official
    chat put the frames' `(<image>./</image>)` joined by newlines."""
    frames = "\n".join(["(<image>./</image>)"] * len(VIDEO["video"]["frame_indices"]))
    assert frames in VIDEO["prompt"]
    return VIDEO["prompt"].replace(frames, "(<video>./</video>)")


def video_bytes() -> bytes:
    return (GOLDEN / VIDEO["media"][0]["file"]).read_bytes()


def test_a_video_is_the_official_chat_with_videos_to_the_bit(preprocessor, golden):
    """The MP4 as a client sends it, with `force_packing` 3 as the golden run: the official ids
    (one `<unk>` run per packed group, groups joined by newlines, no image ids), each chosen
    frame's pixels, two grid rows of three frames each, the frames' temporal ids."""
    from tokenizers import Tokenizer

    out = preprocessor(video_prompt(), [], [video_bytes()], PACKED)
    assert np.array_equal(out.input_ids, golden["d_video/input_ids"])
    tokenizer = Tokenizer.from_file(str(GOLDEN / "tokenizer.json"))
    assert tokenizer.decode(out.input_ids.tolist(), skip_special_tokens=False) == VIDEO["expanded_prompt"]
    (h, w), = np.unique(golden["d_video/tgt_sizes"], axis=0)
    assert out.grid_thw.tolist() == [[len(g), h, w] for g in VIDEO["temporal_ids"]]
    assert out.temporal_ids.tolist() == [i for g in VIDEO["temporal_ids"] for i in g]
    for i in range(len(VIDEO["video"]["frame_indices"])):
        rows = out.pixel_values[i * h * w:(i + 1) * h * w]
        assert np.array_equal(rows, golden_rows(golden[f"d_video/pixel_codes/{i}"], h, w)), i
    assert len(out.pixel_values) == len(VIDEO["video"]["frame_indices"]) * h * w
    n = len(out.input_ids)
    assert np.array_equal(out.mrope_position_ids, np.broadcast_to(np.arange(n), (3, n)))


def test_the_chosen_frames_are_the_golden_ones_decoded_alike():
    """The family's sampler on the MP4 picks the golden frame indices, and PyAV decodes them to the
    golden RGB bytes (the official README decodes with decord; the golden set with PyAV)."""
    import hashlib
    from functools import partial

    from triton_vlm.families.minicpmv.v4_5 import sample_frames
    from triton_vlm.media.videos import decode_video

    frames, meta = decode_video(video_bytes(), "videos[0]", partial(sample_frames, fps=VIDEO["video"]["choose_fps"]))
    assert meta.frames_indices.tolist() == VIDEO["video"]["frame_indices"]
    assert (meta.total_num_frames, meta.fps) == (VIDEO["video"]["decoded_num_frames"], VIDEO["video"]["decoded_fps"])
    assert [hashlib.sha256(f.tobytes()).hexdigest() for f in frames] == VIDEO["video"]["frames_rgb_sha256"]


def test_without_force_packing_a_short_video_is_one_group_a_frame(preprocessor, golden):
    """The official packing of a 2 s video is 1: six groups, six runs joined by newlines."""
    out = preprocessor(video_prompt(), [], [video_bytes()])
    assert out.grid_thw[:, 0].tolist() == [1] * 6 and out.temporal_ids.tolist() == VIDEO["video"]["frame_indices"]
    unk, newline = (int(golden["d_video/input_ids"][i]) for i in (7, 15))  # inside the first run, after it
    runs = np.flatnonzero(np.diff(np.r_[0, out.input_ids == unk, 0]) == 1)
    assert len(runs) == 6 and all(out.input_ids[r + 9] == newline for r in runs[:-1])
    assert len(out.input_ids) == len(golden["d_video/input_ids"]) + 4 * (8 + 3)


def test_an_image_beside_a_video_keeps_its_slices_and_id(preprocessor, golden):
    """Images keep the processor config's slicing and image ids; only the video's frames take the
    chat-with-video settings. The image's ids are those of the image alone."""
    image_case = CASES["a_image_640x480"]
    image = (GOLDEN / image_case["media"][0]["file"]).read_bytes()
    alone = preprocessor("(<image>./</image>)", [image], [])
    both = preprocessor("(<image>./</image>)(<video>./</video>)", [image], [video_bytes()], PACKED)
    assert both.input_ids[:len(alone.input_ids)].tolist() == alone.input_ids.tolist()
    assert both.grid_thw.tolist() == alone.grid_thw.tolist() + [[3, 28, 37]] * 2
    assert both.temporal_ids.tolist() == [-1] * len(alone.grid_thw) + VIDEO["video"]["frame_indices"]


@pytest.mark.parametrize("limits, options, message", [
    (dict(max_video_frames=4), {}, r"^videos\[0\]: 6 frames exceed max_frames=4$"),
    (dict(max_frame_patches=2000), PACKED,
     r"^videos\[0\]: 3108 patches per packed group of frames exceed max_frame_patches=2000$"),
    ({}, {"num_frames": 4}, r"^videos\[0\]: num_frames: MiniCPM-V 4.5 chooses frames by fps"),
    ({}, {"force_packing": 0}, r"^mm_options: force_packing must be a positive integer$"),
])
def test_a_video_over_a_limit_is_refused_naming_it(limits, options, message):
    from triton_vlm.contract.limits import Limits
    from triton_vlm.errors import InvalidInput

    with pytest.raises(InvalidInput, match=message):
        Preprocessor(GOLDEN, Limits(**limits))(video_prompt(), [], [video_bytes()], options)


def test_max_frames_caps_the_frames_chosen(preprocessor):
    out = preprocessor(video_prompt(), [], [video_bytes()], {"max_frames": 4, **PACKED})
    assert out.grid_thw[:, 0].tolist() == [3, 1] and len(out.temporal_ids) == 4
