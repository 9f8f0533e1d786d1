"""Issue #28: LLaVA-OneVision's `preprocess` against transformers' `LlavaOnevisionProcessor` on the
tiny demo checkpoint (70 px tiles of 14 px patches, pinpoints up to 3 x 3 tiles, "anyres_max_4"),
and on one whose tiles are not a whole number of patches (40 px in 14 px patches, as the real
384 px in 14: the patch embedding leaves the remainder out).

`input_ids` (each `<image>` / `<video>` expanded to the processor's count), `pixel_values` (bit
for bit, as rows: `patch_rows` of the processor's views of each item, which are its base view and
tiles for one image, one square view each for several) and the items' sizes (`grid_thw` [views,
S, S]) equal the processor's; the prompt's images go to the processor as one sample (nested), as
its chat template passes them.
"""
from __future__ import annotations

import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from tests.oracle import decode_frames
from triton_vlm.errors import InvalidInput
from triton_vlm.families.llava.demo import grid_pinpoints
from triton_vlm.families.llava.onevision import IMAGE_TOKEN as IMG
from triton_vlm.families.llava.onevision import VIDEO_TOKEN as VID
from triton_vlm.families.llava.tower import patch_rows
from triton_vlm.media import samples

CASES = [[(640, 480)], [(60, 300)], [(1920, 1080)], [(70, 70)], [(31, 17)], [(200, 100), (31, 17)],
         [(640, 480), (90, 700), (70, 70)]]


TILES = {"70px": dict(), "40px-remainder": dict(vision=dict(image_size=40), pinpoints=grid_pinpoints(40, 3))}
PATCH = 14


@pytest.fixture(scope="module", params=list(TILES))
def checkpoint(request, tmp_path_factory):
    from triton_vlm.families.demo import write_demo_checkpoint

    return write_demo_checkpoint("llava_onevision", tmp_path_factory.mktemp("ov"), "tiny", overrides=TILES[request.param])


def tile(processor) -> int:
    return processor.image_processor.size["height"]


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


def assert_views(ref_pixels, grid_thw: np.ndarray, pixel_values: np.ndarray, patch: int) -> None:
    """Each item's first `views` of the processor's padded [items, views, 3, H, W], as rows."""
    rows = np.concatenate([patch_rows(np.asarray(ref_pixels[i, :t]), patch) for i, t in enumerate(grid_thw[:, 0])])
    np.testing.assert_array_equal(rows, pixel_values)


@pytest.mark.parametrize("sizes", CASES, ids=lambda s: "+".join(f"{w}x{h}" for w, h in s))
def test_images_match_processor(sizes, processor, preprocessor):
    pil, raw = zip(*[image(w, h, i) for i, (w, h) in enumerate(sizes)])
    text = "describe " + " and ".join(IMG for _ in sizes) + " please"
    ref = processor(text=[text], images=[list(pil)], return_tensors="np")
    out = preprocessor(text, list(raw))
    np.testing.assert_array_equal(out.input_ids, ref["input_ids"][0])
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    side = tile(processor) // PATCH
    views = [image_size_to_num_patches((h, w), processor.image_processor.image_grid_pinpoints, tile(processor))
             if len(sizes) == 1 else 1 for w, h in sizes]
    assert out.grid_thw.tolist() == [[v, side, side] for v in views]
    np.testing.assert_array_equal(ref["image_sizes"], [[h, w] for w, h in sizes])
    assert_views(ref["pixel_values"], out.grid_thw, out.pixel_values, PATCH)
    counts = processor._get_num_multimodal_tokens(image_sizes=[[h, w] for w, h in sizes])["num_image_tokens"]
    if len(sizes) == 1:
        assert int((out.input_ids == preprocessor.image_token_id).sum()) == counts[0]
    np.testing.assert_array_equal(out.mrope_position_ids, np.tile(np.arange(len(out.input_ids)), (3, 1)))


@pytest.mark.parametrize("with_image", [False, True], ids=["video", "image+video"])
def test_video_matches_processor(with_image, processor, preprocessor):
    video = samples.video_bytes(seconds=1.0, fps=5, width=96, height=64)
    frames, _ = decode_frames(video)
    pil, raw = image(300, 200, 3)
    text = (IMG + " then " if with_image else "") + VID + " what moves?"
    ref = processor(text=[text], images=[[pil]] if with_image else None, videos=[frames], return_tensors="np")
    out = preprocessor(text, [raw] if with_image else [], [video])
    np.testing.assert_array_equal(out.input_ids, ref["input_ids"][0])
    n, side = len(frames), tile(processor) // PATCH
    assert out.grid_thw[-1].tolist() == [n, side, side]
    video_rows = patch_rows(ref["pixel_values_videos"][0], PATCH)
    np.testing.assert_array_equal(out.pixel_values[-len(video_rows):], video_rows)
    if with_image:
        assert_views(ref["pixel_values"], out.grid_thw[:1], out.pixel_values[:-len(video_rows)], PATCH)
    assert int((out.input_ids == preprocessor.video_token_id).sum()) == n * ((side + 1) // 2) ** 2 + 1


@pytest.mark.parametrize("option", [{"fps": 1.0}, {"num_frames": 2}, {"max_frames": 3}, {"min_pixels": 1000}])
def test_sampling_and_size_options_are_refused(option, preprocessor):
    """The processor takes every frame (no `do_sample_frames`) and sizes images by its own config."""
    video = samples.video_bytes(seconds=1.0, fps=5, width=96, height=64)
    with pytest.raises(InvalidInput, match=rf"mm_options: {next(iter(option))} does not apply: llava_onevision"):
        preprocessor(VID, [], [video], option)
