"""Fuzz: mutated JPEG / PNG / MP4 / WebM bytes through `preprocess` give a result or `InvalidInput`
(with a message naming the input and no internal details), never another exception or a hang.

Bounded: a fixed number of derandomized examples (the same ones every run, so CI is
reproducible), each with a generous deadline that only a hang would reach.
"""
from __future__ import annotations

import io
from datetime import timedelta

import av
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.test_preprocess import IMG, VID
from triton_vlm.contract.limits import Limits
from triton_vlm.errors import InvalidInput
from triton_vlm.preprocessing.preprocessor import Preprocessor


def _image(fmt: str) -> bytes:
    yy, xx = np.mgrid[0:40, 0:56]
    array = np.stack([xx * 4, yy * 6, (xx + yy) * 3], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt)
    return buf.getvalue()


def _video(codec: str, fmt: str) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(12):
            array = np.full((48, 64, 3), (i * 20) % 256, np.uint8)
            array[8:24, i * 3:i * 3 + 16] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


SEEDS = {
    "jpeg": (_image("JPEG"), "image"),
    "png": (_image("PNG"), "image"),
    "mp4_h264": (_video("libx264", "mp4"), "video"),
    "webm_vp9": (_video("libvpx-vp9", "webm"), "video"),
}

_mutation = st.tuples(st.sampled_from(["flip", "overwrite", "insert", "delete", "truncate", "big_int"]),
                      st.floats(0.0, 1.0), st.integers(0, 255))


def _mutate(data: bytes, mutations) -> bytes:
    out = bytearray(data)
    for op, where, value in mutations:
        if not out:
            break
        i = min(int(where * len(out)), len(out) - 1)
        if op == "flip":
            out[i] ^= 1 << (value % 8)
        elif op == "overwrite":
            out[i] = value
        elif op == "insert":
            out[i:i] = bytes([value]) * (1 + value % 7)
        elif op == "delete":
            del out[i:i + 1 + value % 16]
        elif op == "truncate":
            del out[i:]
        else:  # a size / count / dimension field made huge
            out[i:i + 4] = b"\x7f\xff\xff" + bytes([value])
    return bytes(out)


@pytest.fixture(scope="module")
def small(ckpt):  # noqa: F811
    # Tight limits, so that a mutated header asking for much is refused quickly rather than decoded.
    return Preprocessor(ckpt, Limits(max_image_pixels=4096 * 4096, max_video_source_frames=3000,
                                     max_video_frames=64))


@settings(max_examples=400, deadline=timedelta(seconds=30), derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.sampled_from(sorted(SEEDS)), mutations=st.lists(_mutation, min_size=1, max_size=4))
def test_mutated_media_give_a_result_or_invalid_input(small, seed, mutations):
    original, kind = SEEDS[seed]
    data = _mutate(original, mutations)
    images, videos = ([data], []) if kind == "image" else ([], [data])
    text = IMG if kind == "image" else VID
    try:
        out = small(text, images, videos)
    except InvalidInput as error:
        message = str(error)
        assert message.startswith(("images[0]: ", "videos[0]: ")), message
        assert "0x" not in message and "/" not in message and "Traceback" not in message, message
    else:
        assert out.pixel_values.dtype == np.float32 and np.isfinite(out.pixel_values).all()
        assert out.grid_thw.shape == (1, 3)
        assert len(out.input_ids) == out.mrope_position_ids.shape[1]


def test_seeds_are_valid(small):
    for data, kind in SEEDS.values():
        out = small(IMG if kind == "image" else VID, [data] if kind == "image" else [],
                    [data] if kind == "video" else [])
        assert out.grid_thw.shape == (1, 3)
