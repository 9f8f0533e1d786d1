"""MiniCPM-V 4.6 `preprocess` against transformers, computed in the same run.

Oracles:
- token ids, grids, pixel values: `AutoProcessor.from_pretrained(ckpt)` of the tiny demo checkpoint
  (`MiniCPMV4_6Processor` with the torchvision-backend image processor and the video processor);
  videos decoded with PyAV and passed as frames + `VideoMetadata`, sampled by the video
  processor's own `sample_frames`. transformers packs pixels as [1, 3, 14, N * 14] and sizes as
  `target_sizes` [M, 2]; `hf_rows` maps them to our rows [N, 3 * 14 * 14] and `grid_thw` [M, 3];
- positions: the position ids the HF model's Qwen3.5 text stack gets (captured at its rotary
  embedding) while `generate` runs on the processor's inputs.
"""
from __future__ import annotations

import json
import re
import shutil
from functools import cache

import numpy as np
import pytest
import torch

from tests.oracle import Oracle, decode_frames
from triton_vlm.errors import InvalidInput
from triton_vlm.families.minicpmv.v4_6 import IMAGE_TOKEN, VIDEO_TOKEN, sample_frames
from triton_vlm.media import samples
from triton_vlm.media.videos import VideoMetadata
from triton_vlm.preprocessing.preprocessor import Preprocessor

PIXEL_TOL = 1e-4
IMG, VID = IMAGE_TOKEN, VIDEO_TOKEN


def chat(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from triton_vlm.families.demo import write_demo_checkpoint

    return write_demo_checkpoint("minicpmv4_6", tmp_path_factory.mktemp("minicpmv4_6-tiny"), "tiny")


@pytest.fixture(scope="module")
def mc(ckpt) -> tuple[Preprocessor, Oracle]:
    return Preprocessor(ckpt), Oracle(ckpt)


@cache
def image(width: int, height: int, fmt: str = "JPEG") -> bytes:
    return samples.image_bytes(width, height, fmt=fmt, seed=width / 7)


@cache
def video(seconds: float, fps: int, width: int = 64, height: int = 48) -> bytes:
    return samples.video_bytes(seconds=seconds, fps=fps, width=width, height=height)


def hf_rows(pixel_values: torch.Tensor) -> np.ndarray:
    """transformers' [1, 3, 14, N * 14] packing as rows [N, 3 * 14 * 14]."""
    _, channels, p, length = pixel_values.shape
    n = length // p
    return pixel_values[0].reshape(channels, p, n, p).permute(2, 0, 1, 3).reshape(n, -1).numpy()


def _media(images=(), videos=()) -> dict:
    """Processor keyword arguments: PIL images; videos decoded as the oracle decodes them and
    sampled by the video processor's own rule."""
    import io

    from PIL import Image

    kwargs = {}
    if images:
        kwargs["images"] = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    if videos:
        decoded = [decode_frames(v) for v in videos]
        kwargs.update(videos=[f for f, _ in decoded], video_metadata=[m for _, m in decoded], do_sample_frames=True)
    return kwargs


def hf_in_prompt_order(hf: Oracle, text: str, out, images=(), videos=(), **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """The processor's pixel rows and `target_sizes` rows (as [1, h, w]) in prompt order. How many
    sizes each item has comes from the image and video processors' own per-item counts."""
    media = _media(images, videos)
    counts = {IMG: [], VID: []}
    if images:
        counts[IMG] = list(hf.processor.image_processor(media["images"], **kwargs)["num_patches_per_image"])
    if videos:
        got = hf.processor.video_processor(videos=media["videos"], video_metadata=media["video_metadata"],
                                           do_sample_frames=True, **kwargs)
        per_frame = got["num_patches_per_frame"].tolist()
        for n in got["num_frames_per_video"]:
            counts[VID].append(sum(per_frame[:n]))
            per_frame = per_frame[n:]
    sources = {IMG: ("pixel_values", "target_sizes"), VID: ("pixel_values_videos", "target_sizes_videos")}
    cursor = {kind: (0, 0) for kind in sources}
    rows, grids = [], []
    for kind in re.findall(re.escape(IMG) + "|" + re.escape(VID), text):
        pixels_key, sizes_key = sources[kind]
        item = len([g for g in grids if g[0] == kind])
        first_size, first_row = cursor[kind]
        sizes = out[sizes_key][first_size:first_size + counts[kind][item]].numpy()
        n = int(sizes.prod(axis=1).sum())
        rows.append(hf_rows(out[pixels_key])[first_row:first_row + n])
        grids.append((kind, sizes))
        cursor[kind] = (first_size + len(sizes), first_row + n)
    grid_rows = np.concatenate([np.pad(sizes, ((0, 0), (1, 0)), constant_values=1) for _, sizes in grids])
    return np.concatenate(rows), grid_rows


@torch.no_grad()
def model_positions(hf: Oracle, out) -> np.ndarray:
    """The rotary position ids [3, S] the HF text stack gets for the prompt (first `generate` step)."""
    captured = []
    rotary = hf.model.model.language_model.rotary_emb
    handle = rotary.register_forward_pre_hook(lambda _module, args: captured.append(args[1].clone()))
    try:
        hf.model.generate(**out, max_new_tokens=1, do_sample=False)
    finally:
        handle.remove()
    return captured[0][:, 0].numpy()


def check_against_hf(pre: Preprocessor, hf: Oracle, text: str, images=(), videos=(), mm_options=None, **kwargs):
    ours = pre(text, list(images), list(videos), mm_options)
    out = hf.processor(text=[text], return_tensors="pt", **_media(images, videos), **kwargs)
    np.testing.assert_array_equal(ours.input_ids, out["input_ids"][0].numpy())
    pixel_values, grid_thw = hf_in_prompt_order(hf, text, out, images, videos, **kwargs)
    np.testing.assert_array_equal(ours.grid_thw, grid_thw)
    np.testing.assert_allclose(ours.pixel_values, pixel_values, rtol=0, atol=PIXEL_TOL)
    return ours, out


# ------------------------------------------------------------------------------ against the processor

SIZES = [(448, 448), (640, 480), (1920, 1080), (4000, 1000), (200, 100)]


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_image_matches_transformers(mc, size):
    pre, hf = mc
    ours, out = check_against_hf(pre, hf, chat(IMG + "What is this?"), [image(*size)])
    if size == (1920, 1080):  # the model runs once here; positions do not depend on the size
        np.testing.assert_array_equal(ours.mrope_position_ids, model_positions(hf, out))
        assert ours.mrope_position_delta == 0


def test_video_matches_transformers(mc):
    """Short clips: whole frames (64x48) and sliced ones (320x240); positions as the model's."""
    pre, hf = mc
    text = chat(VID + "What moves?" + VID)
    ours, out = check_against_hf(pre, hf, text, videos=[video(3.5, 4), video(2, 5, 320, 240)])
    np.testing.assert_array_equal(ours.mrope_position_ids, model_positions(hf, out))
    assert ours.mrope_position_delta == 0


def test_mix_matches_transformers(mc):
    """Images and videos interleaved: each kind numbered from 0 by `<image_id>`, in prompt order."""
    pre, hf = mc
    text = chat(IMG + "and" + VID + "then" + IMG + "\n" + VID)
    images, videos = [image(640, 480), image(20, 90, "PNG")], [video(2, 4), video(3, 5, 320, 200)]
    ours, out = check_against_hf(pre, hf, text, images, videos)
    np.testing.assert_array_equal(ours.mrope_position_ids, model_positions(hf, out))


def test_two_digit_image_ids_match_transformers(mc):
    """Eleven images: `<image_id>10</image_id>` tokenizes as the processor's whole-text call does."""
    pre, hf = mc
    images = [image(32 + 4 * i, 40) for i in range(11)]
    check_against_hf(pre, hf, chat(" ".join([IMG] * 11) + "Which differ?"), images)


def test_max_frames_matches_transformers(mc):
    """A request's max_frames caps frames as the processor's max_num_frames does (0.1 s grid)."""
    pre, hf = mc
    ours, _ = check_against_hf(pre, hf, chat(VID), videos=[video(3.5, 4)], mm_options={"max_frames": 2},
                               max_num_frames=2)
    assert ours.grid_thw.shape[0] == 2


@pytest.mark.parametrize("settings", [dict(downsample_mode="4x"), dict(use_image_id=False), dict(slice_mode=False)],
                         ids=["4x", "no-image-id", "no-slices"])
def test_processor_settings_match_transformers(ckpt, tmp_path, settings):
    """A checkpoint whose processor config changes the token count, the numbering or the slicing."""
    changed = shutil.copytree(ckpt, tmp_path / "ckpt")
    config = json.loads((changed / "processor_config.json").read_text())
    for section in ("image_processor", "video_processor"):
        config[section].update(settings)
    (changed / "processor_config.json").write_text(json.dumps(config))
    pre, hf = Preprocessor(changed), Oracle(changed)
    check_against_hf(pre, hf, chat(IMG + VID), [image(1920, 1080)], [video(2, 4, 320, 240)])


# ------------------------------------------------------------------------------ frame sampling

@pytest.mark.parametrize("total,fps", [(1, 1.0), (14, 4.0), (30, 30.0), (95, 29.97), (7, 2.5), (400, 2.0),
                                       (3000, 10.0), (4000, 25.0)])
@pytest.mark.parametrize("max_num_frames", [128, 16])
def test_sample_frames_matches_transformers(mc, total, fps, max_num_frames):
    from transformers.video_utils import VideoMetadata as HFMetadata

    _, hf = mc
    meta = VideoMetadata(total_num_frames=total, fps=fps, width=64, height=48, duration=total / fps)
    expected = hf.processor.video_processor.sample_frames(
        HFMetadata(total_num_frames=total, fps=fps, duration=total / fps), max_num_frames=max_num_frames)
    np.testing.assert_array_equal(sample_frames(meta, max_num_frames=max_num_frames), expected)


# ------------------------------------------------------------------------------ bad input

def test_bad_requests_fail_by_name(mc):
    pre, _ = mc
    with pytest.raises(InvalidInput, match=r"images\[0\]: aspect ratio .* exceeds max_aspect_ratio=200"):
        pre(chat(IMG), [image(4020, 20, "PNG")])
    with pytest.raises(InvalidInput, match="num_frames"):
        pre(chat(VID), [], [video(2, 4)], {"num_frames": 4})
    with pytest.raises(InvalidInput, match="mm_options: max_pixels does not apply"):
        pre(chat(IMG), [image(64, 64)], [], {"max_pixels": 100000})
    with pytest.raises(InvalidInput, match="1 image placeholders but 2 images"):
        pre(chat(IMG), [image(64, 64), image(64, 64)])
