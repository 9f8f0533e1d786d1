"""MiniCPM-V 4.5's vision path in torch (`triton_vlm.vision.minicpmv4_5`) against the official
golden values: NaViT position ids exact, the first slice's `vpm` hidden state and every slice's
resampler rows (`vision_embeds`) within 1e-4, from our preprocess of the golden JPEGs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.minicpmv4_5_golden import CASES, GOLDEN, IMAGE_CASES
from triton_vlm.preprocess import Preprocessor
from triton_vlm.vision.minicpmv4_5 import MiniCPMV45Vision, navit_position_ids

MEDIA_CASES = [case for case in IMAGE_CASES if CASES[case]["media"]]


@pytest.fixture(scope="module")
def vision():
    return MiniCPMV45Vision(GOLDEN)


@pytest.mark.parametrize("case", MEDIA_CASES)
def test_vision_rows_equal_the_official(vision, golden, case):
    c = CASES[case]
    out = Preprocessor(GOLDEN)(c["prompt"], [(GOLDEN / m["file"]).read_bytes() for m in c["media"]], [])
    for i, (_, h, w) in enumerate(out.grid_thw.tolist()):
        assert np.array_equal(navit_position_ids(h, w, vision.side), golden[f"{case}/vision_position_ids/{i}"]), i
    pixels = torch.from_numpy(out.pixel_values)
    _, h, w = out.grid_thw[0].tolist()
    hidden = vision.tower(pixels[:h * w], h, w)
    assert torch.allclose(hidden, torch.from_numpy(golden[f"{case}/vpm_hidden/0"]), atol=1e-4, rtol=0)
    rows = vision(pixels, torch.from_numpy(out.grid_thw))
    expected = torch.from_numpy(golden[f"{case}/vision_embeds"]).reshape(rows.shape)
    assert torch.allclose(rows, expected, atol=1e-4, rtol=0), (rows - expected).abs().max()


def test_a_videos_packed_frames_are_resampled_together_as_the_official(vision, golden):
    """The golden video's six decoded frames (the PNGs), preprocessed as images (320x240: no
    slices), in two packed groups of three with their temporal ids: the two golden rows' sets."""
    video = CASES["d_video"]["video"]
    out = Preprocessor(GOLDEN)("(<image>./</image>)" * 6, [(GOLDEN / f).read_bytes() for f in video["frames_png"]], [])
    assert np.array_equal(out.grid_thw[:, 1:], golden["d_video/tgt_sizes"])
    rows = vision(torch.from_numpy(out.pixel_values), torch.from_numpy(out.grid_thw), video["temporal_ids"])
    expected = torch.from_numpy(golden["d_video/vision_embeds"]).reshape(rows.shape)
    assert torch.allclose(rows, expected, atol=1e-4, rtol=0), (rows - expected).abs().max()


def test_frames_are_chosen_and_packed_as_the_official_chat_with_video():
    from triton_vlm.families.minicpmv4_5 import choose_frames

    video = CASES["d_video"]["video"]
    indices, groups = choose_frames(video["decoded_num_frames"], video["decoded_fps"], video["choose_fps"],
                                    video["force_packing"])
    assert indices.tolist() == video["frame_indices"] and groups == video["temporal_ids"]
    indices, groups = choose_frames(30 * 100, 30.0)  # 100 s at 3 frames a second: 300 > 180, packed by 2
    assert len(indices) == 300 and {len(g) for g in groups} == {2} and len(groups) == 150
    indices, groups = choose_frames(30 * 600, 30.0)  # 600 s: 180 x 3 frames, packed by 3
    assert len(indices) == 540 and {len(g) for g in groups} == {3}
