"""MiniCPM-Llama3-V 2.5 end to end (`minicpmv2_5`: the official `MiniCPMV` class of version 2.5,
transformers' Idefics2 vision tower and the 2-D resampler on Llama 3) behind a real tritonserver,
served from the official golden checkpoint as it is (`tests/golden/minicpmv2_5`: the official remote
code under transformers 4.40.0, torch 2.1.2): every case's ids (two `<|begin_of_text|>`), image
bounds, `tgt_sizes` and pixels, the tower's rows with every slice padded to the request's largest
(ONNX and torch), logits and greedy tokens are the official ones, the text-only case too
(`tests.minicpmv_golden.GoldenChecks`). Also: the slice grid is the official choice, a padding
smaller than a slice is refused naming it, and the demo checkpoint builds and serves."""
from __future__ import annotations

import math
import re
import subprocess
import sys

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from tests.minicpmv_golden import SETS, GoldenChecks, engine_tokens, pytest_generate_tests  # noqa: F401 (pytest's hook)
from tests.test_e2e import infer_direct, media_values

GOLDEN = SETS["minicpmv2_5"]


class TestMiniCPMV2_5(GoldenChecks):
    GOLDEN = GOLDEN

    def test_a_slice_padded_to_fewer_patches_than_it_holds_is_invalid_arg(self, server):
        """`vision_encoder` takes `padded_patches` from any client: below a slice's h * w (or past a
        frame's limit) it is refused naming the input, and the server goes on serving."""
        out = infer_direct(server, "preprocess", media_values(*GOLDEN.request("a_image_480x640")),
                           ["pixel_values", "grid_thw", "padded_patches"])
        values = {"pixel_values": (out["pixel_values"], "FP32"), "grid_thw": (out["grid_thw"], "INT64")}
        for padded in (np.ravel(out["padded_patches"]) - 1, np.full(len(out["grid_thw"]), 10**6)):
            with pytest.raises(InferenceServerException) as refused:
                infer_direct(server, "vision_encoder", {**values, "padded_patches": (padded, "INT64")}, ["embeddings"])
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert re.match(r"^padded_patches: frame 0 of 1036 patches padded to \d+; each must lie in "
                            r"\[its frame's h \* w, max_frame_patches=65536\]$", refused.value.message())
        rows = infer_direct(server, "vision_encoder", {**values, "padded_patches": (out["padded_patches"], "INT64")},
                            ["embeddings"])["embeddings"]
        np.testing.assert_allclose(rows, GOLDEN.values["a_image_480x640/vision_embeds"].reshape(rows.shape), atol=1e-4)


def official_grid(height: int, width: int, max_slice_nums: int, scale_resolution: int) -> tuple[int, int] | None:
    """The README's `get_sliced_grid` of 2.5, as (rows, cols): candidates multiple - 1 .. + 1,
    each one's [cols, rows] for every divisor cols ascending, the first of the smallest error."""
    multiple = min(math.ceil(width * height / scale_resolution ** 2), max_slice_nums)
    if multiple <= 1:
        return None
    best, error = None, float("inf")
    for n in (multiple - 1, multiple, multiple + 1):
        if n == 1 or n > max_slice_nums:
            continue
        for cols in (m for m in range(1, n + 1) if n % m == 0):
            e = abs(math.log(width / height) - math.log(cols / (n // cols)))
            if e < error:
                best, error = (n // cols, cols), e
    return best


def test_the_slice_grid_is_the_official_choice():
    """`_sliced_grid` (ours, shared with 2.6 on: larger rows on a tie) picks 2.5's grid: the golden
    images' `slice_grids`, and the README's rule over a sweep of sizes (ties across candidates
    would need two logs to fall equally far from the image's, which the sweep never meets)."""
    from triton_vlm.families.minicpmv.slicing import _sliced_grid
    from triton_vlm.preprocessing.preprocessor import Preprocessor

    settings = Preprocessor(GOLDEN.root).image_settings
    for case in GOLDEN.media_cases:
        for media, grid in zip(GOLDEN.cases[case]["media"], GOLDEN.cases[case]["slice_grids"]):
            assert _sliced_grid(media["height"], media["width"], settings) == (grid and (grid[1], grid[0])), case
    for height in range(14, 4000, 61):
        for width in range(14, 4000, 67):
            assert _sliced_grid(height, width, settings) == official_grid(height, width, 9, 448), (height, width)


def test_the_demo_checkpoint_builds_and_serves(tmp_path_factory):
    """`triton-vlm demo-checkpoint --family minicpmv2_5` writes a checkpoint detected as 2.5 that
    builds and serves: two images (one sliced: its slices padded to its largest) answer as the
    pieces in process do (preprocess, the torch tower, the llm)."""
    from tests.servers import LEAN, served
    from tests.test_e2e import grpc_tokens
    from triton_vlm.families import detect_family
    from triton_vlm.media import samples
    from triton_vlm.preprocessing.preprocessor import Preprocessor
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    checkpoint = tmp_path_factory.mktemp("minicpmv2_5-demo") / "checkpoint"
    subprocess.run([sys.executable, "-m", "triton_vlm.tools.cli", "demo-checkpoint", "--family", "minicpmv2_5",
                    "--out", str(checkpoint)], check=True, timeout=600)
    assert detect_family(checkpoint).name == "minicpmv2_5"
    prompt = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n(<image>./</image>)\n(<image>./</image>)\n"
              "What is this?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    images = [samples.image_bytes(300, 180), samples.image_bytes(64, 96)]
    with served(checkpoint, tmp_path_factory, "minicpmv2_5-demo-repo", LEAN) as server:
        tokens = grpc_tokens(server, prompt, images, [], max_tokens=6)
    out = Preprocessor(checkpoint)(prompt, images, [])
    assert len(out.grid_thw) > 2 and set(out.extras["padded_patches"]) == {out.grid_thw.prod(axis=1).max()}
    padded = {"padded_patches": out.extras["padded_patches"]}
    rows = TorchEncoder(checkpoint).encode(out.pixel_values, out.grid_thw, padded)
    assert tokens == engine_tokens(checkpoint, out.input_ids, rows, 6) and len(tokens) >= 1
