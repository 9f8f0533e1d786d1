"""InternVL's `preprocess` against transformers' `InternVLProcessor` (GotOcr2 tiles, every video
frame) on the tiny demo checkpoint (56 px tiles of 14 px patches, at most 6 tiles).

`input_ids` (each `<IMG_CONTEXT>` an `<img>` ... `</img>` run over its tiles, each `<video>` its
"FrameN:" lines), `pixel_values` (bit for bit: the processor's tiles, thumbnails and frames, as
patch rows, prompt order) and the grids (one [1, S, S] per tile or frame) equal the processor's;
the tile grid equals `get_optimal_tiled_canvas` over many aspects, ties included.
"""
from __future__ import annotations

import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from tests.oracle import decode_frames
from triton_vlm.errors import InvalidInput
from triton_vlm.families.internvl.processor import IMAGE_TOKEN as IMG
from triton_vlm.families.internvl.processor import VIDEO_TOKEN as VID
from triton_vlm.families.internvl.processor import tile_grid
from triton_vlm.families.llava.tower import patch_rows
from triton_vlm.media import samples

PATCH, TILE = 14, 56
# One tile (square, small), many tiles and a thumbnail (wide, tall, large), a tie between grids
# (112 x 56: 2 x 1 or 4 x 2), an odd size, several images.
CASES = [[(56, 56)], [(640, 480)], [(60, 300)], [(1920, 1080)], [(112, 56)], [(31, 17)], [(200, 100), (31, 17)],
         [(640, 480), (90, 700), (56, 56)]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from triton_vlm.families.demo import write_demo_checkpoint

    return write_demo_checkpoint("internvl", tmp_path_factory.mktemp("internvl"), "tiny")


@pytest.fixture(scope="module")
def processor(checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def preprocessor(checkpoint):
    from triton_vlm.preprocessing.preprocessor import Preprocessor

    return Preprocessor(checkpoint)


def image(width: int, height: int, seed: int):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return Image.fromarray(pixels), buffer.getvalue()


def test_tile_grid_is_transformers_canvas():
    from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

    for height in (10, 56, 100, 112, 300, 448, 1000):
        for width in (10, 56, 100, 112, 224, 300, 1344, 4000):
            for low, high in ((1, 12), (1, 6), (2, 4), (1, 1)):
                assert tile_grid(height, width, (TILE, TILE), low, high) == \
                    get_optimal_tiled_canvas((height, width), (TILE, TILE), low, high), (height, width, low, high)


@pytest.mark.parametrize("sizes", CASES, ids=lambda s: "+".join(f"{w}x{h}" for w, h in s))
def test_images_match_processor(sizes, processor, preprocessor):
    pil, raw = zip(*[image(w, h, i) for i, (w, h) in enumerate(sizes)])
    text = "<|im_start|>user\n" + "".join(IMG + "\n" for _ in sizes) + "describe please<|im_end|>\n"
    ref = processor(text=[text], images=list(pil), return_tensors="np")
    out = preprocessor(text, list(raw))
    np.testing.assert_array_equal(out.input_ids, ref["input_ids"][0])
    side = TILE // PATCH
    assert out.grid_thw.tolist() == [[1, side, side]] * len(ref["pixel_values"])
    np.testing.assert_array_equal(out.pixel_values, patch_rows(ref["pixel_values"], PATCH))
    np.testing.assert_array_equal(out.mrope_position_ids, np.tile(np.arange(len(out.input_ids)), (3, 1)))


@pytest.mark.parametrize("with_image", [False, True], ids=["video", "image+video"])
@pytest.mark.parametrize("before", ["\n", " then", "look:"], ids=["after-newline", "after-word", "after-colon"])
def test_video_matches_processor(with_image, before, processor, preprocessor):
    """Also where text runs into the first "Frame1: " label (the processor encodes them together)."""
    video = samples.video_bytes(seconds=1.0, fps=5, width=96, height=64)
    frames, _ = decode_frames(video)
    pil, raw = image(300, 200, 3)
    text = "<|im_start|>user" + before + (IMG + "\n" if with_image else "") + VID + "\nwhat moves?<|im_end|>\n"
    ref = processor(text=[text], images=[pil] if with_image else None, videos=[frames], return_tensors="pt")
    out = preprocessor(text, [raw] if with_image else [], [video])
    np.testing.assert_array_equal(out.input_ids, ref["input_ids"][0].numpy())
    side = TILE // PATCH
    assert out.grid_thw.tolist() == [[1, side, side]] * len(ref["pixel_values"])
    np.testing.assert_array_equal(out.pixel_values, patch_rows(ref["pixel_values"].numpy(), PATCH))
    assert len(frames) == 5 and int((out.input_ids == preprocessor.image_token_id).sum()) >= 5 * side * side // 4


def test_text_only_matches_processor(processor, preprocessor):
    text = "<|im_start|>user\ntell me about a red car<|im_end|>\n<|im_start|>assistant\n"
    ref = processor(text=[text], return_tensors="np")["input_ids"][0]
    np.testing.assert_array_equal(preprocessor(text).input_ids, ref)


@pytest.mark.parametrize("option", [{"fps": 1.0}, {"num_frames": 2}, {"min_pixels": 1000}])
def test_sampling_and_size_options_are_refused(option, preprocessor):
    """The processor takes every frame (no `do_sample_frames`) and tiles images by its own config."""
    video = samples.video_bytes(seconds=1.0, fps=5, width=96, height=64)
    with pytest.raises(InvalidInput, match=rf"mm_options: {next(iter(option))} does not apply: internvl"):
        preprocessor(VID, [], [video], option)


def test_a_video_processor_that_samples_frames_is_refused(checkpoint, tmp_path):
    """`do_sample_frames` on in the saved video processor: not implemented, refused by name."""
    import json
    import shutil

    from triton_vlm.preprocessing.preprocessor import Preprocessor

    copy = shutil.copytree(checkpoint, tmp_path / "sampling")
    config = json.loads((copy / "processor_config.json").read_text())
    config["video_processor"].update(do_sample_frames=True, num_frames=4)
    (copy / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="InternVL: the video processor's do_sample_frames is not supported"):
        Preprocessor(copy).warmup()
