"""`limits`: each breach is InvalidInput naming the input and the limit; the limits are build
options (BuildOptions, `triton-vlm build` flags) that reach `PreprocessModel` as config parameters."""
from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from tests.test_preprocess import IMG, VID, _image_bytes, _video_bytes
from triton_vlm.contract.limits import DEFAULT_LIMITS, Limits
from triton_vlm.errors import InvalidInput
from triton_vlm.preprocessing.preprocessor import Preprocessor


def _png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose IHDR (with a valid CRC) claims width x height."""
    data = bytearray(_image_bytes(8, 8, "PNG"))
    ihdr = 8  # after the signature: length(4) type(4) data(13) crc(4)
    body = b"IHDR" + struct.pack(">II", width, height) + bytes(data[ihdr + 16:ihdr + 21])
    data[ihdr + 4:ihdr + 21] = body
    data[ihdr + 21:ihdr + 25] = struct.pack(">I", zlib.crc32(body))
    return bytes(data)


@pytest.mark.parametrize("width,height", [(9000, 9000), (30000, 30000)])
def test_decompression_bomb_refused_from_the_header(pre, width, height):
    data = _png_claiming(width, height)
    assert len(data) < 1000
    with pytest.raises(InvalidInput, match=r"^images\[0\]: .*exceeds max_image_pixels=67108864$"):
        pre(IMG, [data])


def test_byte_limits(ckpt):
    img = _image_bytes(64, 48, "PNG")
    small = Preprocessor(ckpt, Limits(max_item_bytes=len(img) - 1, max_request_bytes=3 * len(img)))
    with pytest.raises(InvalidInput, match=rf"^images\[0\]: {len(img)} bytes exceed max_item_bytes={len(img) - 1}$"):
        small(IMG, [img])
    with pytest.raises(InvalidInput, match=r"^images\[1\]: \d+ bytes exceed max_item_bytes"):
        small(IMG * 2, [img[:100], base64.b64encode(img)])
    ok = Preprocessor(ckpt, Limits(max_request_bytes=2 * len(img) + 10))
    ok(IMG * 2, [img, img])
    with pytest.raises(InvalidInput, match=rf"^images, videos: {3 * len(img)} bytes in all exceed "
                                           rf"max_request_bytes={2 * len(img) + 10}$"):
        ok(IMG * 3, [img, img, img])


def test_prompt_token_limit(ckpt):
    img = _image_bytes(640, 480, "PNG")
    full = Preprocessor(ckpt)(IMG + "hello", [img])
    n = len(full.input_ids)
    exact = Preprocessor(ckpt, Limits(max_prompt_tokens=n))
    assert len(exact(IMG + "hello", [img]).input_ids) == n
    tight = Preprocessor(ckpt, Limits(max_prompt_tokens=n - 1))
    with pytest.raises(InvalidInput, match=rf"^text_input: prompt is {n} tokens after expanding media, "
                                           rf"exceeds max_prompt_tokens={n - 1}$"):
        tight(IMG + "hello", [img])
    with pytest.raises(InvalidInput, match=r"^text_input: prompt is \d+ tokens, exceeds max_prompt_tokens=5$"):
        Preprocessor(ckpt, Limits(max_prompt_tokens=5))("a b c d e f g h i j k l")


def test_frame_item_aspect_limits(ckpt):
    video = _video_bytes(3, 10)
    limited = Preprocessor(ckpt, Limits(max_video_frames=4, max_video_source_frames=20, max_media_items=1,
                                        max_aspect_ratio=2.0))
    with pytest.raises(InvalidInput, match=r"^videos\[0\]: .*max_video_source_frames=20"):
        limited(VID, [], [video])
    with pytest.raises(InvalidInput, match=r"^images, videos: 2 media items exceed max_media_items=1$"):
        limited(IMG + VID, [_image_bytes(8, 8, "PNG")], [video])
    with pytest.raises(InvalidInput, match=r"^images\[0\]: aspect ratio 3.0 of 300x100 exceeds max_aspect_ratio=2$"):
        limited(IMG, [_image_bytes(300, 100, "PNG")])


def test_media_are_bytes_only(pre, tmp_path):
    """A path or URL is not media: nothing is read from disk or fetched."""
    real = tmp_path / "real.png"
    real.write_bytes(_image_bytes(32, 32, "PNG"))
    for item in (str(real).encode(), b"file://" + str(real).encode(), b"http://127.0.0.1:1/x.png"):
        with pytest.raises(InvalidInput, match=r"^images\[0\]: (not a decodable image \(\d+ bytes: not an image format Pillow reads\)|invalid base64)$"):
            pre(IMG, [item])
    with pytest.raises(InvalidInput, match=r"^videos\[0\]: "):
        pre(VID, [], [str(real).encode()])


def test_limits_are_build_options(tiny_checkpoint):
    import json

    from triton_vlm.families import detect_family
    from triton_vlm.repository.configs import model_configs
    from triton_vlm.repository.options import BuildOptions
    from triton_vlm.tools.cli import parser

    limits = Limits(max_item_bytes=1234, max_request_bytes=5678, max_image_pixels=99, max_video_frames=8,
                    max_video_source_frames=100, max_media_items=3, max_aspect_ratio=50.5, max_prompt_tokens=777)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    configs = model_configs(detect_family(tiny_checkpoint), config, BuildOptions(limits=limits))
    params = {k: v.string_value for k, v in configs["preprocess"].parameters.items()}
    assert Limits.from_params(params) == limits  # what PreprocessModel.initialize reads
    args = parser().parse_args(["build", "--checkpoint", "c", "--repo", "r", "--max-item-bytes", "1234",
                                "--max-aspect-ratio", "50.5", "--max-prompt-tokens", "777"])
    got = Limits.from_params({k: str(v) for k, v in vars(args).items() if v is not None})
    assert got == Limits(max_item_bytes=1234, max_aspect_ratio=50.5, max_prompt_tokens=777)
    assert Limits.from_params({}) == DEFAULT_LIMITS
    with pytest.raises(ValueError):
        Limits.from_params({"max_media_items": "0"})


def test_error_messages_carry_no_internals(pre):
    bad = [(IMG, [b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4], []),
           (VID, [], [b"\x00\x00\x00\x18ftypmp42" + bytes(500)]),
           (VID, [], [_video_bytes(1, 10)[:300]])]
    for text, images, videos in bad:
        with pytest.raises(InvalidInput) as info:
            pre(text, images, videos)
        message = str(info.value)
        assert message.split(":")[0] in ("images[0]", "videos[0]")
        assert "0x" not in message and "/" not in message and "Error" not in message, message
    assert np.asarray(Image.open(io.BytesIO(_image_bytes(4, 4, "PNG")))).shape == (4, 4, 3)
