"""MiniCPM-V 4.5's vision tower (`triton_vlm.families.minicpmv.tower_resampler`) against the official
golden values: a video's packed frames with their temporal ids resampled together as the official
does, in torch, through the torch encoder and through the ONNX export in ONNX Runtime, and the
frames chosen and their temporal ids (the images' rows are checked through the server and the torch
encoder: `tests/test_e2e_minicpmv4_5.py`)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.minicpmv4_5_golden import CASES, GOLDEN
from tests.minicpmv_golden import close
from triton_vlm.families.minicpmv.tower_resampler import MiniCPMV4_5Tower, metadata
from triton_vlm.preprocessing.preprocessor import Preprocessor


@pytest.fixture(scope="module")
def tower():
    return MiniCPMV4_5Tower.load_tower(GOLDEN).eval()


@pytest.fixture(scope="module")
def settings():
    return MiniCPMV4_5Tower.read_vision_config(GOLDEN)


@pytest.fixture(scope="module")
def onnx_encoder(tmp_path_factory):
    from triton_vlm.vision.runtime.encoder import VisionEncoder
    from triton_vlm.vision.runtime.export import export_onnx

    return VisionEncoder(export_onnx(GOLDEN, tmp_path_factory.mktemp("minicpmv4_5") / "vision.onnx"))


def run(tower, pixels: np.ndarray, grid: np.ndarray, settings: dict, temporal_ids=None) -> torch.Tensor:
    meta = metadata(grid, settings, temporal_ids)
    with torch.inference_mode():
        return tower(torch.from_numpy(pixels), *(torch.from_numpy(meta[k]) for k in MiniCPMV4_5Tower.METADATA_INPUTS))


def test_a_videos_packed_frames_are_resampled_together_as_the_official(tower, settings, golden):
    """The golden video's six decoded frames (the PNGs), preprocessed as images (320x240: no
    slices), in two packed groups of three with their temporal ids: the two golden rows' sets."""
    video = CASES["d_video"]["video"]
    out = Preprocessor(GOLDEN)("(<image>./</image>)" * 6, [(GOLDEN / f).read_bytes() for f in video["frames_png"]], [])
    assert np.array_equal(out.grid_thw[:, 1:], golden["d_video/tgt_sizes"])
    groups = np.array([[len(ids), *out.grid_thw[0, 1:]] for ids in video["temporal_ids"]])
    flat = np.concatenate(video["temporal_ids"])
    close(run(tower, out.pixel_values, groups, settings, flat), golden["d_video/vision_embeds"])


def test_the_encoders_resample_a_served_videos_groups_as_the_official(onnx_encoder, golden):
    """The MP4 through our preprocess (force_packing 3 as the golden run): the torch encoder and
    ONNX Runtime give the golden rows from the grid rows and temporal ids preprocess gives; the
    batched encoder keys its cache on the temporal ids too (the same pixels with other ids are
    other rows)."""
    from triton_vlm.vision.batching import BatchedEncoder, EmbeddingCache
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    video = CASES["d_video"]
    prompt = video["prompt"].replace("\n".join(["(<image>./</image>)"] * 6), "(<video>./</video>)")
    out = Preprocessor(GOLDEN)(prompt, [], [(GOLDEN / video["media"][0]["file"]).read_bytes()], {"force_packing": 3})
    for encoder in (TorchEncoder(GOLDEN), onnx_encoder):
        close(encoder.encode(out.pixel_values, out.grid_thw, out.extras), golden["d_video/vision_embeds"])
    batched = BatchedEncoder(onnx_encoder, EmbeddingCache(1 << 20))
    shifted = out.temporal_ids + 100
    (rows, moved), stats = batched.encode_many([(out.pixel_values, out.grid_thw, {"temporal_ids": out.temporal_ids}),
                                                (out.pixel_values, out.grid_thw, {"temporal_ids": shifted})])
    close(rows, golden["d_video/vision_embeds"])
    assert stats.misses == 4 and np.abs(moved - rows).max() > 1e-3
    close(moved, onnx_encoder.encode(out.pixel_values, out.grid_thw, {"temporal_ids": shifted}))


def test_temporal_ids_are_the_official_nearest_points():
    """`temporal_ids` (no grid materialised) against the official `map_to_nearest_scale` over
    `np.arange(0, duration, TIME_SCALE)`, ties included (frame times on the grid's midpoints)."""
    from triton_vlm.families.minicpmv.v4_5 import TIME_SCALE, temporal_ids

    rng = np.random.default_rng(0)
    for fps in (10.0, 20.0, 29.97, 30.0, 7.5, 0.5):
        total = int(rng.integers(5, 4000))
        duration = total / fps
        indices = np.unique(rng.integers(0, total, 64))
        scale = np.arange(0, duration, TIME_SCALE)
        nearest = scale[np.abs(scale - (indices / fps)[:, None]).argmin(axis=1)]
        assert temporal_ids(indices, fps, duration) == (nearest / TIME_SCALE).astype(np.int32).tolist(), fps


def test_frames_are_chosen_and_packed_as_the_official_chat_with_video():
    from triton_vlm.families.minicpmv.v4_5 import choose_frames

    video = CASES["d_video"]["video"]
    indices, groups = choose_frames(video["decoded_num_frames"], video["decoded_fps"], video["choose_fps"],
                                    video["force_packing"])
    assert indices.tolist() == video["frame_indices"] and groups == video["temporal_ids"]
    indices, groups = choose_frames(30 * 100, 30.0)  # 100 s at 3 frames a second: 300 > 180, packed by 2
    assert len(indices) == 300 and {len(g) for g in groups} == {2} and len(groups) == 150
    indices, groups = choose_frames(30 * 600, 30.0)  # 600 s: 180 x 3 frames, packed by 3
    assert len(indices) == 540 and {len(g) for g in groups} == {3}
