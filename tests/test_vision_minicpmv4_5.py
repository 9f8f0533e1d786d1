"""MiniCPM-V 4.5's vision path in torch (`triton_vlm.vision.minicpmv4_5`) against the official
golden values: NaViT position ids exact, the first slice's `vpm` hidden state and every slice's
resampler rows (`vision_embeds`) within 1e-4, from our preprocess of the golden JPEGs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_llm_minicpmv4_5 import CASES, GOLDEN
from tests.test_preprocess_minicpmv4_5 import IMAGE_CASES
from triton_vlm.preprocess import Preprocessor
from triton_vlm.vision.minicpmv4_5 import MiniCPMV45Vision, navit_position_ids

MEDIA_CASES = [case for case in IMAGE_CASES if CASES[case]["media"]]


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN / "golden.npz") as npz:
        return {key: npz[key] for key in npz.files}


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
