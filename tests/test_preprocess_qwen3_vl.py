"""Qwen3-VL `preprocess` against transformers, computed in the same run (Qwen3-VL-MoE shares the
processor rules: its checkpoint gets the mixed case).

Oracles: `AutoProcessor.from_pretrained(ckpt)` of the tiny demo checkpoint (`Qwen3VLProcessor` with
`Qwen2VLImageProcessor` and `Qwen3VLVideoProcessor`) for token ids (the video timestamps and
per-frame spans included), grids and pixel values; `get_rope_index` of the HF model for positions;
the video processor's own `sample_frames` for frame indices.
"""
from __future__ import annotations

import re
from functools import cache

import numpy as np
import pytest

from tests.oracle import Oracle, rows_in_prompt_order
from triton_vlm.errors import InvalidInput
from triton_vlm.families.qwen3_vl import QWEN3_VL
from triton_vlm.families.qwen3_vl.processor import frame_timestamps
from triton_vlm.media import samples
from triton_vlm.preprocessing.items import bind_sampler
from triton_vlm.preprocessing.preprocessor import Preprocessor

IMG, VID = QWEN3_VL.image_placeholder, QWEN3_VL.video_placeholder
PIXEL_TOL = 1e-4


def chat(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """family -> (Preprocessor, Oracle) of its tiny demo checkpoint, built on first use."""
    from triton_vlm.families.demo import write_demo_checkpoint

    built = {}

    def get(family: str) -> tuple[Preprocessor, Oracle]:
        if family not in built:
            ckpt = write_demo_checkpoint(family, tmp_path_factory.mktemp(f"{family}-tiny"), "tiny")
            built[family] = Preprocessor(ckpt), Oracle(ckpt)
        return built[family]
    return get


@cache
def video(seconds: float, fps: int, width: int = 96, height: int = 64) -> bytes:
    return samples.video_bytes(seconds=seconds, fps=fps, width=width, height=height)


@cache
def image(width: int, height: int, fmt: str = "JPEG") -> bytes:
    return samples.image_bytes(width, height, fmt=fmt, seed=width / 7)


def hf_in_prompt_order(text: str, out) -> tuple[np.ndarray, np.ndarray]:
    """The HF processor's pixel rows and grids in the order of the placeholders in `text` (the prompt
    before expansion)."""
    return rows_in_prompt_order(re.findall(r"<\|(image|video)_pad\|>", text), out)


def check_against_hf(pre: Preprocessor, hf: Oracle, text: str, images=(), videos=(), mm_options=None, **hf_kwargs):
    ours = pre(text, list(images), list(videos), mm_options)
    out = hf.inputs(text, list(images), list(videos), **{"fps": None, **hf_kwargs})
    np.testing.assert_array_equal(ours.input_ids, out["input_ids"][0].numpy())
    pixel_values, grid_thw = hf_in_prompt_order(text, out)
    np.testing.assert_array_equal(ours.grid_thw, grid_thw)
    assert ours.pixel_values.shape == pixel_values.shape
    assert np.abs(ours.pixel_values - pixel_values).max() <= PIXEL_TOL
    positions, delta = hf.rope_index(out)
    np.testing.assert_array_equal(ours.mrope_position_ids, positions)
    assert ours.mrope_position_delta == delta
    return ours, out


CASES = {
    "image": (IMG + "What is this?", [image(300, 200)], []),
    "small_image": (IMG + "What is this?", [image(20, 90, "PNG")], []),  # below min_pixels: scaled up
    "large_image": (IMG + "What is this?", [image(900, 700)], []),  # above max_pixels: scaled down
    "two_images": (IMG + "and" + IMG + "compare", [image(300, 200), image(120, 180, "PNG")], []),
    "video": (VID + "What moves?", [], [video(4, 4)]),
    "video_odd_frames": (VID + "What moves?", [], [video(2.5, 6)]),  # 5 frames: the last repeated
    "long_video": (VID + "What moves?", [], [video(45, 2, 64, 48)]),
    "image_and_video": (IMG + "and" + VID + "then" + IMG, [image(300, 200), image(120, 180, "PNG")], [video(4, 4)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(qwen3, case):
    pre, hf = qwen3("qwen3_vl")
    content, images, videos = CASES[case]
    ours, out = check_against_hf(pre, hf, chat(content), images, videos)
    assert ours.grid_thw.shape[0] == len(images) + len(videos)
    if videos:  # one span per temporal patch, each after its timestamp, inside the prompt's own markers
        frames = int(out["video_grid_thw"][:, 0].sum())
        assert hf.processor.tokenizer.decode(out["input_ids"][0]).count(" seconds>") == frames


def test_moe_checkpoint_preprocesses_alike(qwen3):
    pre, hf = qwen3("qwen3_vl_moe")
    check_against_hf(pre, hf, chat(CASES["image_and_video"][0]), *CASES["image_and_video"][1:])


@pytest.mark.parametrize("options", [{"fps": 1}, {"num_frames": 6}, {"max_pixels": 16 * 32 * 32}])
def test_request_options_match_transformers(qwen3, options):
    pre, hf = qwen3("qwen3_vl")
    kwargs = dict(options)
    if "max_pixels" in kwargs:
        kwargs = {"size": {"shortest_edge": 4 * 32 * 32, "longest_edge": kwargs["max_pixels"]}}
        prompt, images, videos = chat(IMG + "what?"), [image(300, 200)], []
    else:
        prompt, images, videos = chat(VID + "what?"), [], [video(4, 4)]
    saved_fps = hf.processor.video_processor.fps
    if "num_frames" in options:  # transformers takes a count only where no rate is set
        hf.processor.video_processor.fps = None
    try:
        check_against_hf(pre, hf, prompt, images, videos, mm_options=options, **kwargs)
    finally:
        hf.processor.video_processor.fps = saved_fps


# ------------------------------------------------------------------------------ frame sampling

# (total frames, fps): 14 frames at 5 samples (6.5 rounds to 6, half to even), fewer frames than
# min_frames, fractional rates, max_frames reached.
METADATA = [(14, 2.5), (4, 30.0), (7, 3.0), (20, 5.0), (45, 30000 / 1001), (120, 4.0), (299, 29.97), (3100, 1.0),
            (2, 24.0)]


def test_sampler_matches_transformers(qwen3):
    from transformers.video_utils import VideoMetadata as HFVideoMetadata

    pre, hf = qwen3("qwen3_vl")
    sampler = bind_sampler(pre.family.processor.sample_frames, pre.video_sampling, pre.video_settings)
    for total, fps in METADATA:
        want = hf.processor.video_processor.sample_frames(HFVideoMetadata(total_num_frames=total, fps=fps)).tolist()
        assert sampler({"total_num_frames": total, "fps": fps, "duration": total / fps}).tolist() == want, (total, fps)
    # 5 of 14 frames: 6.5 rounds to 6 (half to even)
    assert pre.family.processor.sample_frames({"total_num_frames": 14, "fps": 2.5}, fps=None,
                                              num_frames=5).tolist() == [0, 3, 6, 10, 13]


def test_timestamps_are_pair_means():
    """`_calculate_timestamps`: an odd count padded with the last frame, each pair's mean."""
    assert frame_timestamps(np.array([0.0, 0.5, 1.0, 1.5, 2.0]), 3, 2) == [0.25, 1.25, 2.0]


def test_videos_transformers_cannot_sample_are_refused(qwen3):
    pre, _ = qwen3("qwen3_vl")
    with pytest.raises(InvalidInput, match="at least 2"):
        pre(chat(VID), [], [samples.video_bytes(seconds=1.0, fps=1, width=64, height=64)])
    with pytest.raises(InvalidInput, match="num_frames=40 asks for more frames than the video's 16"):
        pre(chat(VID), [], [video(4, 4)], {"num_frames": 40})


def test_capped_frames_match_transformers(qwen3, tmp_path):
    """A video processor config with `cap_pixels_per_frame`: every frame gets its share of the
    budget, at least 1.05 `shortest_edge` (here more than the uncapped budget gives a long video)."""
    import json
    import shutil

    pre, hf = qwen3("qwen3_vl")
    checkpoint = shutil.copytree(hf.checkpoint, tmp_path / "capped")
    config = json.loads((checkpoint / "processor_config.json").read_text())
    config["video_processor"]["cap_pixels_per_frame"] = True
    (checkpoint / "processor_config.json").write_text(json.dumps(config))
    capped = Preprocessor(checkpoint)
    prompt, videos = chat(VID + "What moves?"), [video(45, 2, 64, 48)]
    ours, _ = check_against_hf(capped, Oracle(checkpoint), prompt, [], videos)
    assert ours.grid_thw.prod() > pre(prompt, [], videos).grid_thw.prod()
