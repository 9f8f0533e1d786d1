"""`preprocess` against the Hugging Face oracle, computed in the same run.

Oracles:
- token ids, grids, pixel values: `AutoProcessor.from_pretrained(ckpt)` of the tiny demo checkpoint,
  i.e. `Qwen2_5_VLProcessor` with the torchvision-backend `Qwen2VLImageProcessor` and
  `Qwen2VLVideoProcessor` (videos decoded here with PyAV and passed as frames + `VideoMetadata`,
  `do_sample_frames=True`, fps 2);
- positions: the reference rule (a direct port of vLLM's `get_mrope_input_positions` below) in
  every case, and transformers' `model.model.get_rope_index` where the two rules agree (images,
  short videos). For a long video the test checks the reference rule and that transformers'
  `start + max(H, W) / 2` rule really differs there.
"""
from __future__ import annotations

import base64
import io
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import av  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from triton_vlm.errors import InvalidInput  # noqa: E402
from triton_vlm.media.mrope import MediaSpan, mrope_positions  # noqa: E402
from triton_vlm.preprocessing.preprocessor import Preprocessor  # noqa: E402

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"
PIXEL_TOL = 1e-4


# ----------------------------------------------------------------------------------- fixtures

def _image_bytes(width, height, fmt, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    # smooth gradients plus noise, so resizing has real work to do
    array[..., 0] = (np.arange(width)[None, :] * 255 // max(width - 1, 1)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, fmt)
    return buf.getvalue()


def _video_bytes(seconds, fps, width=160, height=120, codec=None, fmt="mp4"):
    if codec is None:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        yy, xx = np.mgrid[0:height, 0:width]
        for i in range(int(seconds * fps)):
            frame = np.stack([(xx * 2 + i * 9) % 256, (yy * 2) % 256, np.full_like(xx, i * 7 % 256)], -1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame.astype(np.uint8), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="session")
def media():
    return {
        "img_640x480": _image_bytes(640, 480, "PNG", seed=1),
        "img_333x517": _image_bytes(333, 517, "JPEG", seed=2),
        "img_30x40_rgba": _image_bytes(30, 40, "PNG", mode="RGBA", seed=3),
        "vid_short": _video_bytes(3, 10),        # 30 frames -> 6 sampled -> grid_t 3
        "vid_long": _video_bytes(6, 5),          # 30 frames at 5 fps -> 12 sampled -> grid_t 6
        "vid_one_frame": _video_bytes(0.1, 10),  # a single frame
    }


# ----------------------------------------------------------------------------------- oracles

def _hf_frames(data):
    """Decode every frame with PyAV, as transformers' pyav backend does, with its metadata."""
    from transformers.video_utils import VideoMetadata

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        fps = float(stream.average_rate)
    meta = VideoMetadata(total_num_frames=len(frames), fps=fps, width=frames.shape[2], height=frames.shape[1],
                         duration=len(frames) / fps, video_backend="pyav")
    return frames, meta


def _hf_run(processor, text, images, videos, **kwargs):
    """HF processor outputs, with pixel rows and grids rearranged into prompt order."""
    call = dict(text=[text], return_tensors="pt")
    if images:
        call["images"] = [Image.open(io.BytesIO(b)) for b in images]
    if videos:
        decoded = [_hf_frames(v) for v in videos]
        call["videos"] = [f for f, _ in decoded]
        call["video_metadata"] = [m for _, m in decoded]
        call.setdefault("do_sample_frames", True)
        call["fps"] = 2.0
    call.update(kwargs)
    out = processor(**call)
    ids = out["input_ids"][0].numpy()
    image_token, video_token = processor.image_token_id, processor.video_token_id
    # prompt order of the media items, from the expanded ids
    starts = np.flatnonzero(np.isin(ids, [image_token, video_token])
                            & ~np.isin(np.concatenate(([-1], ids[:-1])), [image_token, video_token]))
    kinds = ["video" if ids[s] == video_token else "image" for s in starts]
    rows, grids, counters = [], [], {"image": 0, "video": 0}
    offsets = {"image": 0, "video": 0}
    for kind in kinds:
        grid_key, pix_key = ("image_grid_thw", "pixel_values") if kind == "image" else \
            ("video_grid_thw", "pixel_values_videos")
        grid = out[grid_key][counters[kind]]
        n = int(grid.prod())
        rows.append(out[pix_key][offsets[kind]:offsets[kind] + n].numpy())
        grids.append(grid.numpy())
        counters[kind] += 1
        offsets[kind] += n
    pixel_values = np.concatenate(rows) if rows else np.zeros((0, 1176), np.float32)
    grid_thw = np.stack(grids) if grids else np.zeros((0, 3), np.int64)
    return out, ids, pixel_values, grid_thw


def _hf_rope(model, out):
    kwargs = dict(input_ids=out["input_ids"], mm_token_type_ids=out["mm_token_type_ids"],
                  image_grid_thw=out.get("image_grid_thw"), video_grid_thw=out.get("video_grid_thw"))
    if "second_per_grid_ts" in out:
        kwargs["second_per_grid_ts"] = out["second_per_grid_ts"]
    with torch.no_grad():
        positions, deltas = model.model.get_rope_index(**kwargs)
    return positions[:, 0].numpy(), int(deltas[0, 0])


def vllm_get_mrope_input_positions(input_tokens, mm_items, spatial_merge_size, tokens_per_second):
    """Direct port of vLLM qwen2_5_vl `iter_mm_grid_thw` + `get_mrope_input_positions`.

    mm_items: (offset, modality, (t, h, w), second_per_grid_ts or None)."""
    def iter_mm_grid_thw():
        for offset, modality, (t, h, w), spgt in sorted(mm_items, key=lambda f: f[0]):
            if modality == "image":
                assert t == 1
                yield offset, 1, h // spatial_merge_size, w // spatial_merge_size, 1.0
            else:
                second_per_grid_ts = spgt if spgt else 1.0
                yield offset, t, h // spatial_merge_size, w // spatial_merge_size, \
                    second_per_grid_ts * tokens_per_second

    llm_pos_ids_list: list = []
    st = 0
    for offset, llm_grid_t, llm_grid_h, llm_grid_w, t_factor in iter_mm_grid_thw():
        text_len = offset - st
        st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
        llm_pos_ids_list.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
        grid_indices = np.indices((llm_grid_t, llm_grid_h, llm_grid_w))
        if t_factor != 1.0:
            grid_indices[0] = (grid_indices[0] * t_factor).astype(np.int64)
        llm_pos_ids_list.append(grid_indices.reshape(3, -1) + text_len + st_idx)
        st = offset + llm_grid_t * llm_grid_h * llm_grid_w
    if st < len(input_tokens):
        st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
        text_len = len(input_tokens) - st
        llm_pos_ids_list.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
    llm_positions = np.concatenate(llm_pos_ids_list, axis=1).reshape(3, -1)
    mrope_position_delta = (llm_positions.max() + 1 - len(input_tokens)).item()
    return llm_positions, mrope_position_delta


def _reference_positions(ckpt_config, hf_out, ids):
    """vLLM-port positions from the HF processor's own outputs."""
    image_id, video_id = ckpt_config["image_token_id"], ckpt_config["video_token_id"]
    is_mm = np.isin(ids, [image_id, video_id])
    starts = np.flatnonzero(is_mm & ~np.concatenate(([False], is_mm[:-1])))
    items, counters = [], {"image": 0, "video": 0}
    for s in starts:
        kind = "video" if ids[s] == video_id else "image"
        grid = hf_out[f"{kind}_grid_thw"][counters[kind]].tolist()
        spgt = float(hf_out["second_per_grid_ts"][counters[kind]]) if kind == "video" else None
        items.append((int(s), kind, grid, spgt))
        counters[kind] += 1
    vision = ckpt_config["vision_config"]
    return vllm_get_mrope_input_positions(ids.tolist(), items, vision["spatial_merge_size"],
                                          vision["tokens_per_second"])


def _long_video_regime(hf_out, ckpt_config) -> bool:
    """Whether a video of the HF outputs is long enough for transformers 5.x's rule (text after a
    video at start + max(h, w) / 2, h and w the patch grid) to differ from the reference `max + 1`:
    the last temporal position int((T - 1) * tokens_per_second * second_per_grid_ts) reaches
    max(h, w) / 2, i.e. the merged grid's max(H, W)."""
    if "video_grid_thw" not in hf_out:
        return False
    vision = ckpt_config["vision_config"]
    m, tps = vision["spatial_merge_size"], vision["tokens_per_second"]
    for (t, h, w), spgt in zip(hf_out["video_grid_thw"].tolist(), hf_out["second_per_grid_ts"].tolist()):
        if int((t - 1) * tps * float(spgt)) >= max(h // m, w // m):
            return True
    return False


def _check_against_hf(pre, hf_processor, hf_model, ckpt_config, text, images, videos, mm_options=None,
                      hf_kwargs=None, hf_positions_agree=True):
    ours = pre(text, images, videos, mm_options)
    out, ids, pixel_values, grid_thw = _hf_run(hf_processor, text, images, videos, **(hf_kwargs or {}))
    assert ours.input_ids.dtype == np.int32 and ours.pixel_values.dtype == np.float32
    assert ours.grid_thw.dtype == np.int64 and ours.mrope_position_ids.dtype == np.int64
    np.testing.assert_array_equal(ours.input_ids, ids)
    np.testing.assert_array_equal(ours.grid_thw, grid_thw)
    assert ours.pixel_values.shape == pixel_values.shape
    if pixel_values.size:
        err = float(np.abs(ours.pixel_values - pixel_values).max())
        assert err <= PIXEL_TOL, err
    # reference rule (vLLM port) always
    ref_pos, ref_delta = _reference_positions(ckpt_config, out, ids)
    np.testing.assert_array_equal(ours.mrope_position_ids, ref_pos)
    assert ours.mrope_position_delta == ref_delta
    # transformers' get_rope_index where the two rules agree
    if hf_positions_agree == "auto":
        hf_positions_agree = not _long_video_regime(out, ckpt_config)
    if grid_thw.shape[0]:
        hf_pos, hf_delta = _hf_rope(hf_model, out)
        if hf_positions_agree:
            np.testing.assert_array_equal(ours.mrope_position_ids, hf_pos)
            assert ours.mrope_position_delta == hf_delta
        else:
            assert not np.array_equal(ours.mrope_position_ids, hf_pos)
    return ours, out


# ----------------------------------------------------------------------------------- parity

def test_image_only_matches_hf(pre, hf_processor, hf_model, ckpt_config, media):
    images = [media["img_640x480"], media["img_333x517"], media["img_30x40_rgba"]]
    text = f"<|im_start|>user\n{IMG}describe {IMG} and {IMG}.<|im_end|>\n<|im_start|>assistant\n"
    ours, _ = _check_against_hf(pre, hf_processor, hf_model, ckpt_config, text, images, [])
    assert ours.grid_thw.shape == (3, 3)


def test_video_only_matches_hf(pre, hf_processor, hf_model, ckpt_config, media):
    text = f"<|im_start|>user\n{VID}what happens?<|im_end|>\n"
    ours, out = _check_against_hf(pre, hf_processor, hf_model, ckpt_config, text, [], [media["vid_short"]])
    assert ours.grid_thw.tolist() == [[3, 8, 12]]
    assert float(out["second_per_grid_ts"][0]) == 1.0


def test_image_video_image_matches_hf(pre, hf_processor, hf_model, ckpt_config, media):
    text = f"<|im_start|>user\n{IMG}first, then {VID} then {IMG} end<|im_end|>\n"
    images = [media["img_333x517"], media["img_640x480"]]
    ours, _ = _check_against_hf(pre, hf_processor, hf_model, ckpt_config, text, images, [media["vid_short"]])
    assert ours.grid_thw[1, 0] == 3  # the video is second, in prompt order


def test_text_only_matches_hf(pre, hf_processor, hf_model, ckpt_config):
    text = "<|im_start|>user\nhow many cats are there?<|im_end|>\n<|im_start|>assistant\n"
    ours, _ = _check_against_hf(pre, hf_processor, hf_model, ckpt_config, text, [], [])
    assert ours.pixel_values.shape == (0, 1176) and ours.grid_thw.shape == (0, 3)
    np.testing.assert_array_equal(ours.mrope_position_ids, np.tile(np.arange(len(ours.input_ids)), (3, 1)))
    assert ours.mrope_position_delta == 0


def test_no_placeholders_go_before_text_images_then_videos(pre, hf_processor, hf_model, ckpt_config, media):
    images, videos = [media["img_30x40_rgba"]], [media["vid_short"]]
    ours = pre("what is this?", images, videos)
    expected = pre(IMG + VID + "what is this?", images, videos)
    np.testing.assert_array_equal(ours.input_ids, expected.input_ids)
    np.testing.assert_array_equal(ours.pixel_values, expected.pixel_values)
    _check_against_hf(pre, hf_processor, hf_model, ckpt_config, IMG + VID + "what is this?", images, videos)


def test_long_video_positions_follow_reference_not_transformers(pre, hf_processor, hf_model, ckpt_config, media):
    """Rule checked: the reference (vLLM) `max(previous) + 1`; transformers' `start + max(H, W) / 2`
    must differ here, since (T - 1) * tokens_per_second * second_per_grid_ts = 10 >= 12 / 2."""
    text = f"{VID}and after the video{IMG}tail"
    ours, out = _check_against_hf(pre, hf_processor, hf_model, ckpt_config, text, [media["img_333x517"]],
                                  [media["vid_long"]], hf_positions_agree=False)
    assert ours.grid_thw[0].tolist() == [6, 8, 12]
    # first text token after the video: max(video positions) + 1
    video_tokens = 6 * 4 * 6
    first_after = 1 + video_tokens
    assert ours.mrope_position_ids[:, first_after].tolist() == \
        [int(ours.mrope_position_ids[:, :first_after].max()) + 1] * 3


def test_mm_options_match_hf(pre, hf_processor, hf_model, ckpt_config, media):
    text = f"{IMG}{VID}options"
    opts = {"min_pixels": 8 * 28 * 28, "max_pixels": 40 * 28 * 28, "num_frames": 4}
    ours, _ = _check_against_hf(
        pre, hf_processor, hf_model, ckpt_config, text, [media["img_640x480"]], [media["vid_short"]],
        mm_options=opts,
        hf_kwargs=dict(size={"shortest_edge": opts["min_pixels"], "longest_edge": opts["max_pixels"]},
                       fps=None, num_frames=4))
    assert ours.grid_thw[1, 0] == 2
    fps4 = pre(f"{VID}", [], [media["vid_short"]], {"fps": 4.0, "max_frames": 8})
    assert fps4.grid_thw[0, 0] == 4  # 30 frames / 10 fps * 4 = 12, capped by max_frames 8


def test_one_frame_video_is_padded(pre, hf_processor, hf_model, ckpt_config, media):
    # transformers divides by zero sampling a one-frame video; fed the frame unsampled it pads to
    # temporal_patch_size by repeating the frame, which is what we must produce.
    ours, _ = _check_against_hf(pre, hf_processor, hf_model, ckpt_config, f"{VID}x", [], [media["vid_one_frame"]],
                                hf_kwargs=dict(do_sample_frames=False))
    assert ours.grid_thw[0, 0] == 1


def test_webm_without_frame_count(pre, hf_processor, hf_model, ckpt_config):
    if "libvpx" not in av.codecs_available:
        pytest.skip("no libvpx")
    data = _video_bytes(2, 10, codec="libvpx", fmt="webm")
    _check_against_hf(pre, hf_processor, hf_model, ckpt_config, f"{VID}webm", [], [data])


def test_base64_and_data_url_match_raw(pre, media):
    raw_img, raw_vid = media["img_333x517"], media["vid_short"]
    text = f"{IMG}{VID}"
    expected = pre(text, [raw_img], [raw_vid])
    b64_img, b64_vid = base64.b64encode(raw_img), base64.b64encode(raw_vid)
    for img, vid in [(b64_img, b64_vid),
                     (b"data:image/jpeg;base64," + b64_img, b"data:video/mp4;base64," + b64_vid),
                     (base64.encodebytes(raw_img), base64.urlsafe_b64encode(raw_vid).rstrip(b"="))]:
        got = pre(text, [img], [vid])
        np.testing.assert_array_equal(got.input_ids, expected.input_ids)
        np.testing.assert_array_equal(got.pixel_values, expected.pixel_values)
        np.testing.assert_array_equal(got.mrope_position_ids, expected.mrope_position_ids)


def test_mrope_matches_reference_port_on_synthetic_spans():
    rng = np.random.default_rng(0)
    for _ in range(20):
        items, spans, pos = [], [], rng.integers(0, 5)
        for _ in range(rng.integers(0, 4)):
            t, h, w = int(rng.integers(1, 6)), 2 * int(rng.integers(1, 6)), 2 * int(rng.integers(1, 6))
            video = bool(rng.integers(0, 2))
            spgt = float(rng.choice([0.5, 1.0, 1.25, 2 / 3])) if video else None
            t = t if video else 1
            items.append((int(pos), "video" if video else "image", (t, h, w), spgt))
            spans.append(MediaSpan(int(pos), t, h // 2, w // 2, spgt * 2 if video else 1.0))
            pos += t * h * w // 4 + rng.integers(0, 4)
        seq_len = int(pos + rng.integers(0, 4))
        if seq_len == 0:
            continue
        ref, ref_delta = vllm_get_mrope_input_positions([0] * seq_len, items, 2, 2)
        got, delta = mrope_positions(seq_len, spans)
        np.testing.assert_array_equal(got, ref)
        assert delta == ref_delta


# ----------------------------------------------------------------------------------- errors

def test_corrupt_image_names_the_input(pre, media):
    with pytest.raises(InvalidInput, match=r"^images\[1\]: not a decodable image \(22 bytes: .+\)$"):
        pre(f"{IMG}{IMG}", [media["img_30x40_rgba"], b"\x89PNG\r\n\x1a\n garbage bytes"], [])


def test_truncated_image_says_how_many_bytes_arrived(pre):
    from triton_vlm.media import samples

    jpeg = samples.image_bytes(64, 48)
    cut = jpeg[: len(jpeg) // 2]
    with pytest.raises(InvalidInput, match=rf"^images\[0\]: not a decodable image \({len(cut)} bytes: .+\)$"):
        pre(IMG, [cut], [])


def test_truncated_video_names_the_input(pre, media):
    data = media["vid_short"]
    with pytest.raises(InvalidInput, match=r"^videos\[0\]: ") as info:
        pre(f"{VID}", [], [data[: len(data) // 2]])
    assert "/" not in str(info.value) and "0x" not in str(info.value)


def test_placeholder_count_mismatch(pre, media):
    with pytest.raises(InvalidInput, match=r"^text_input: 2 image placeholders but 1 images given$"):
        pre(f"{IMG}{IMG}", [media["img_30x40_rgba"]], [])
    with pytest.raises(InvalidInput, match=r"^text_input: 0 video placeholders but 1 videos given$"):
        pre(f"{IMG}", [media["img_30x40_rgba"]], [media["vid_short"]])


def test_bad_mm_options(pre, media):
    for bad in ({"colour": 1}, {"fps": -1}, {"num_frames": "4"}, {"max_pixels": True},
                {"fps": 2, "num_frames": 4}, "[1, 2]", "{not json", {"max_frames": 10_000}):
        with pytest.raises(InvalidInput, match=r"^mm_options: "):
            pre(f"{IMG}", [media["img_30x40_rgba"]], [], bad)
    with pytest.raises(InvalidInput, match=r"^mm_options: force_packing does not apply: qwen2_5_vl does not pack"):
        pre(f"{VID}", [], [media["vid_short"]], {"force_packing": 2})


def test_limits(pre, media, ckpt):
    from triton_vlm.contract.limits import Limits

    small = Preprocessor(ckpt, Limits(max_media_items=2, max_image_pixels=200 * 200, max_video_frames=4))
    with pytest.raises(InvalidInput, match=r"max_media_items=2"):
        small(IMG * 3, [media["img_30x40_rgba"]] * 3, [])
    with pytest.raises(InvalidInput, match=r"^images\[0\]: .*max_image_pixels=40000"):
        small(IMG, [media["img_640x480"]], [])
    with pytest.raises(InvalidInput, match=r"^videos\[0\]: 6 frames exceed max_frames=4"):
        small(VID, [], [media["vid_short"]])
    with pytest.raises(InvalidInput, match=r"^images\[0\]: aspect ratio"):
        pre(IMG, [_image_bytes(1000, 4, "PNG")], [])
