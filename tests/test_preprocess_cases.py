"""The case table of issue #3: `preprocess` against the Hugging Face processor, same run.

Every row goes through `_check_against_hf` (tests/test_preprocess.py): input_ids, grid_thw and
pixel values against `Qwen2_5_VLProcessor` (torchvision backends) of the tiny checkpoint, positions
against the reference rule (vLLM port) and, where the two rules agree, transformers'
`get_rope_index`. Images reach the oracle as `Image.open(...)` objects, so its own `convert_to_rgb`
does the mode conversion; videos as every PyAV-decoded frame plus `VideoMetadata`, sampled by the
oracle (`do_sample_frames=True`, fps 2 unless the row says otherwise).
"""
from __future__ import annotations

import io
from fractions import Fraction
from functools import partial

import av
import numpy as np
import pytest
from PIL import Image

from tests.test_preprocess import IMG, VID, _check_against_hf, _image_bytes
from triton_vlm.errors import InvalidInput


def _check(*args, **kwargs):
    """`_check_against_hf`; positions always by the reference rule, and against transformers where
    its rule agrees (no video in the long regime, see `_long_video_regime`)."""
    return _check_against_hf(*args, hf_positions_agree="auto", **kwargs)

# ------------------------------------------------------------------------------------ images


def _save(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _rgb(width, height, seed=0) -> Image.Image:
    return Image.open(io.BytesIO(_image_bytes(width, height, "PNG", seed=seed))).convert("RGB")


def _rgba(width, height, seed=0) -> Image.Image:
    rgba = _rgb(width, height, seed).convert("RGBA")
    alpha = np.linspace(0, 255, width * height).reshape(height, width).astype(np.uint8)
    rgba.putalpha(Image.fromarray(alpha, "L"))
    return rgba


def _palette_with_transparency() -> bytes:
    p = _rgb(48, 40, 4).quantize(16)
    return _save(p, "PNG", transparency=3)


def _animated_gif() -> bytes:
    frames = [_rgb(60, 44, s).quantize(64) for s in (5, 6, 7)]
    return _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


def _i16_png() -> bytes:
    ramp = (np.arange(50 * 70, dtype=np.uint16).reshape(50, 70) * 13) % 65535
    image = Image.fromarray(ramp)
    assert image.mode == "I;16"
    return _save(image, "PNG")


IMAGE_CASES = {
    "rgb_jpeg_non_multiple_333x517": lambda: _image_bytes(333, 517, "JPEG", seed=2),
    "rgba_png_composited": lambda: _save(_rgba(64, 50), "PNG"),
    "la_png_composited": lambda: _save(_rgba(40, 64, 1).convert("LA"), "PNG"),
    "p_png_with_transparency": _palette_with_transparency,
    "l_png": lambda: _save(_rgb(45, 71, 3).convert("L"), "PNG"),
    "i16_png": _i16_png,
    "cmyk_jpeg": lambda: _save(_rgb(80, 60, 8).convert("CMYK"), "JPEG"),
    "webp": lambda: _save(_rgb(90, 70, 9), "WEBP"),
    "animated_gif_first_frame": _animated_gif,
    "tiny_1x1": lambda: _image_bytes(1, 1, "PNG"),
    "tiny_3x500": lambda: _image_bytes(3, 500, "PNG"),
    "tiny_500x3": lambda: _image_bytes(500, 3, "PNG"),
    "aspect_199_5_to_1": lambda: _image_bytes(798, 4, "PNG"),
    "aspect_1_to_199_5": lambda: _image_bytes(4, 798, "PNG"),
    "large_downscaled_1201x899": lambda: _image_bytes(1201, 899, "JPEG", seed=11),
}


@pytest.mark.parametrize("case", sorted(IMAGE_CASES))
def test_image_case(case, pre, hf_processor, hf_model, ckpt_config):
    data = IMAGE_CASES[case]()
    mode = Image.open(io.BytesIO(data)).mode
    assert mode in {"RGB", "RGBA", "LA", "P", "L", "I;16", "I", "CMYK"}, mode
    _check(pre, hf_processor, hf_model, ckpt_config, f"<|im_start|>user\n{IMG}what?<|im_end|>\n",
                      [data], [])


def test_animated_gif_uses_the_first_frame(pre):
    data = _animated_gif()
    first = Image.open(io.BytesIO(data))
    first.seek(0)
    still = _save(first.convert("RGB"), "PNG")
    np.testing.assert_array_equal(pre(IMG, [data]).pixel_values, pre(IMG, [still]).pixel_values)


@pytest.mark.parametrize("size", [(201, 1), (1, 201), (1000, 4)])
def test_aspect_ratio_over_200_fails_like_hf(size, pre, hf_processor):
    data = _image_bytes(*size, "PNG")
    with pytest.raises(InvalidInput, match=r"^images\[0\]: aspect ratio .* exceeds max_aspect_ratio=200$"):
        pre(IMG, [data])
    with pytest.raises(ValueError, match="aspect ratio"):
        hf_processor(text=[IMG], images=[Image.open(io.BytesIO(data))], return_tensors="pt")


def test_exif_orientation_as_transformers_load_image(pre, hf_processor):
    """Bytes reach HF through `load_image`, which applies the EXIF orientation; so do we."""
    import base64

    from transformers.image_utils import load_image

    image = _rgb(64, 40, 12)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display
    data = _save(image, "JPEG", exif=exif.tobytes())
    hf_image = load_image(base64.b64encode(data).decode())
    assert hf_image.size == (40, 64)
    ref = hf_processor(text=[IMG], images=[hf_image], return_tensors="pt")
    ours = pre(IMG, [data])
    np.testing.assert_array_equal(ours.grid_thw, ref["image_grid_thw"].numpy())
    assert float(np.abs(ours.pixel_values - ref["pixel_values"].numpy()).max()) <= 1e-4


# ------------------------------------------------------------------------------------ videos

# The codecs of the issue that this machine's PyAV (FFmpeg build) can encode, with their container;
# a codec missing here is not in the table (no silent skip): the ids say which ran.
_WANTED_CODECS = [("h264", "libx264", "mp4"), ("h265", "libx265", "mp4"), ("vp9", "libvpx-vp9", "webm"),
                  ("av1", "libsvtav1", "mp4"), ("av1", "libaom-av1", "mp4")]
CODECS = []
for _label, _encoder, _fmt in _WANTED_CODECS:
    if _encoder in av.codecs_available and _label not in {c[0] for c in CODECS}:
        CODECS.append((_label, _encoder, _fmt))


def _encode(frames: list[np.ndarray], rate, codec: str = "libx264", fmt: str = "mp4", pts=None,
            time_base=None, rotation: int | None = None) -> bytes:
    buf = io.BytesIO()
    height, width = frames[0].shape[:2]
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx265":
            stream.options = {"x265-params": "log-level=error"}
        if time_base is not None:
            stream.time_base = time_base
            stream.codec_context.time_base = time_base
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for i, array in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[i], time_base
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _frames(n: int, width: int = 96, height: int = 64, seed: int = 0) -> list[np.ndarray]:
    yy, xx = np.mgrid[0:height, 0:width]
    return [np.stack([(xx * 3 + i * 11 + seed) % 256, (yy * 4 + i * 5) % 256,
                      np.full_like(xx, (i * 29 + seed) % 256)], -1).astype(np.uint8) for i in range(n)]


VIDEO_CASES = {
    **{f"codec_{label}": (lambda enc=enc, fmt=fmt: _encode(_frames(20), 10, enc, fmt))
       for label, enc, fmt in CODECS},
    "fps_29_97": lambda: _encode(_frames(45), Fraction(30000, 1001)),
    "variable_frame_rate": lambda: _encode(
        _frames(24), 25, pts=[0, 40, 70, 130, 150, 200, 260, 270, 330, 400, 420, 480, 520, 600, 610, 680,
                              720, 790, 800, 880, 930, 960, 1040, 1100], time_base=Fraction(1, 1000)),
    "odd_7_frames": lambda: _encode(_frames(7), 10),
    "odd_13_frames": lambda: _encode(_frames(13, 70, 90), 5),
    "odd_31_frames_non_multiple_size": lambda: _encode(_frames(31, 110, 74), 12),
    "h264_b_frames_long_gop": lambda: _encode(_frames(90, 64, 48), 30),
}


@pytest.mark.parametrize("case", sorted(VIDEO_CASES))
def test_video_case(case, pre, hf_processor, hf_model, ckpt_config):
    data = VIDEO_CASES[case]()
    _check(pre, hf_processor, hf_model, ckpt_config, f"<|im_start|>user\n{VID}what?<|im_end|>\n",
                      [], [data])


def test_codec_table_is_what_pyav_encodes():
    """The video table holds one row per issue codec this PyAV can encode (and decode)."""
    available = {label for label, enc, _ in _WANTED_CODECS if enc in av.codecs_available}
    assert {c[0] for c in CODECS} == available
    assert "h264" in available  # the bench and the fast path need it
    for label, _, _ in CODECS:
        assert {"h264": "h264", "h265": "hevc", "vp9": "vp9", "av1": "av1"}[label] in av.codecs_available


def test_one_frame_video_padded_to_temporal_patch(pre, hf_processor, hf_model, ckpt_config):
    data = _encode(_frames(1), 10)
    ours, _ = _check(pre, hf_processor, hf_model, ckpt_config, f"{VID}x", [], [data],
                                hf_kwargs=dict(do_sample_frames=False))
    assert ours.grid_thw[0, 0] == 1


def test_rotation_metadata_as_the_hf_loader(pre, tmp_path):
    """transformers' pyav loader returns frames as stored (it ignores the display matrix); so do we."""
    from transformers.video_utils import load_video

    from triton_vlm.families.qwen2_5_vl.processor import sample_frames
    from triton_vlm.media.videos import decode_video

    data = _encode(_frames(10, 96, 64), 10, rotation=90)
    with av.open(io.BytesIO(data)) as container:
        first = next(container.decode(video=0))
        assert first.rotation != 0  # the file really carries rotation metadata
    path = tmp_path / "rotated.mp4"
    path.write_bytes(data)
    sampler = partial(sample_frames, fps=2.0)
    hf_frames, hf_meta = load_video(str(path), backend="pyav", sample_indices_fn=lambda metadata, **_: sampler(metadata))
    frames, meta = decode_video(data, "videos[0]", sampler)
    assert frames.shape == hf_frames.shape == (4, 64, 96, 3)
    np.testing.assert_array_equal(frames, hf_frames)
    np.testing.assert_array_equal(meta.frames_indices, hf_meta.frames_indices)


class _FakeStream:
    def __init__(self, average_rate, guessed_rate, duration=None, time_base=Fraction(1, 1000)):
        self.average_rate, self.guessed_rate = average_rate, guessed_rate
        self.duration, self.time_base = duration, time_base


class _FakeContainer:
    duration = None


@pytest.mark.parametrize("rates", [(None, None), (Fraction(0, 1), None), (Fraction(0, 1), Fraction(0, 1))])
def test_fps_missing_or_zero_comes_from_timestamps(rates):
    from triton_vlm.media.videos import _FALLBACK_FPS, _stream_fps

    stream = _FakeStream(*rates)
    assert _stream_fps(stream, _FakeContainer(), 11, [0, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]) == 10.0
    assert _stream_fps(stream, _FakeContainer(), 5, [0, 0]) == _FALLBACK_FPS  # no span: no division by zero
    assert _stream_fps(_FakeStream(*rates, duration=2000), _FakeContainer(), 8, []) == 4.0
    assert _stream_fps(stream, _FakeContainer(), 0, []) == _FALLBACK_FPS


def test_h264_fast_path_equals_full_decode(monkeypatch):
    """The packet-skipping H.264 path keeps exactly the frames decoding everything would."""
    from triton_vlm.families.qwen2_5_vl.processor import sample_frames
    from triton_vlm.media import videos as media

    data = _encode(_frames(150, 64, 48), 30)
    for sampler in (partial(sample_frames, fps=2.0), partial(sample_frames, num_frames=6),
                    partial(sample_frames, fps=0.5)):
        video = media.demux_video(data, "v")
        assert media._h264_plan(video.facts, video.packets) is not None
        fast, fast_meta = media.decode_video(data, "v", sampler)
        with monkeypatch.context() as m:
            m.setattr(media, "_h264_plan", lambda *a: None)
            full, full_meta = media.decode_video(data, "v", sampler)
        np.testing.assert_array_equal(fast, full)
        np.testing.assert_array_equal(fast_meta.frames_indices, full_meta.frames_indices)


# ------------------------------------------------------------------------------------ mixes, options

def test_mixed_order_many_items(pre, hf_processor, hf_model, ckpt_config):
    h264 = _encode(_frames(20, 96, 64), 10)
    other = _encode(_frames(15, 64, 80, seed=3), 5, *(CODECS[-1][1:]))
    images = [_image_bytes(50, 90, "JPEG", seed=1), _save(_rgba(33, 20, 2), "PNG"), _image_bytes(3, 100, "PNG")]
    text = f"{VID}first {IMG} then {VID}{IMG} and {IMG}end"
    ours, _ = _check(pre, hf_processor, hf_model, ckpt_config, text, images, [h264, other])
    assert ours.grid_thw[:, 0].tolist()[0] > 1 and ours.grid_thw[1, 0] == 1


@pytest.mark.parametrize("options,hf_kwargs", [
    ({"fps": 1.0}, {"fps": 1.0}),
    ({"max_frames": 4}, {"max_frames": 4}),
    ({"num_frames": 6}, {"fps": None, "num_frames": 6}),
    ({"min_pixels": 40 * 28 * 28}, {"size": {"shortest_edge": 40 * 28 * 28, "longest_edge": 256 * 28 * 28},
                                    "videos_kwargs": None}),
    ({"max_pixels": 6 * 28 * 28}, {"size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 6 * 28 * 28}}),
    # below the checkpoint's min_pixels: transformers takes it, and smart_resize caps at max_pixels first
    ({"max_pixels": 2 * 28 * 28}, {"size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 2 * 28 * 28}}),
])
def test_mm_option_override(options, hf_kwargs, pre, hf_processor, hf_model, ckpt_config):
    hf_kwargs = {k: v for k, v in hf_kwargs.items() if k != "videos_kwargs"}
    if "min_pixels" in options:  # the video section's own max_pixels stays
        hf_kwargs = {"images_kwargs": {"size": hf_kwargs["size"]},
                     "videos_kwargs": {"size": {"shortest_edge": 40 * 28 * 28, "longest_edge": 64 * 28 * 28}}}
    if "max_pixels" in options:
        hf_kwargs = {"images_kwargs": {"size": hf_kwargs["size"]},
                     "videos_kwargs": {"size": hf_kwargs["size"]}}
    video = _encode(_frames(30, 96, 64), 10)
    _check(pre, hf_processor, hf_model, ckpt_config, f"{IMG}{VID}", [_image_bytes(300, 200, "PNG")],
                      [video], mm_options=options, hf_kwargs=hf_kwargs)


def test_planned_video_falls_back_to_full_decode(pre, monkeypatch):
    """When the H.264 fast path cannot vouch for its frames, phase 2 decodes everything instead
    and the outputs are the same."""
    from triton_vlm.media import videos as media

    data = _encode(_frames(40, 96, 64), 10)
    expected = pre(f"{IMG}{VID}", [_image_bytes(90, 60, "JPEG")], [data])
    monkeypatch.setattr(media.PlannedVideo, "decode", lambda self, store: False)
    got = pre(f"{IMG}{VID}", [_image_bytes(90, 60, "JPEG")], [data])
    np.testing.assert_array_equal(got.pixel_values, expected.pixel_values)
    np.testing.assert_array_equal(got.input_ids, expected.input_ids)
    np.testing.assert_array_equal(got.mrope_position_ids, expected.mrope_position_ids)


def test_a_bug_of_ours_is_not_an_undecodable_input(pre, monkeypatch):
    """Only the decoders' own errors become InvalidInput; an error of our code around them (here a
    TypeError in the frame conversion, on the H.264 fast path and on the full decode, and in
    the image conversion) propagates, so the server answers INTERNAL instead of blaming the input."""
    from triton_vlm.media import videos as media
    from triton_vlm.preprocessing import items as preprocess

    def broken(*args, **kwargs):
        raise TypeError("a bug of ours")

    h264 = _encode(_frames(20, 96, 64), 10)
    with monkeypatch.context() as m:
        m.setattr(preprocess, "frame_rgb", broken)  # the fast path's frame store
        with pytest.raises(TypeError, match="a bug of ours"):
            pre(VID, [], [h264])
    with monkeypatch.context() as m:
        m.setattr(media, "_h264_plan", lambda *a: None)  # no fast path: the full decode
        m.setattr(media, "frame_rgb", broken)
        with pytest.raises(TypeError, match="a bug of ours"):
            pre(VID, [], [h264])
    with monkeypatch.context() as m:
        m.setattr(Image.Image, "convert", broken)
        with pytest.raises(TypeError, match="a bug of ours"):
            pre(IMG, [_save(_rgb(40, 30).convert("L"), "PNG")])
