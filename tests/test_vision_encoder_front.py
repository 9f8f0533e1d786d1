"""The `vision_encoder` front without Triton (`triton_vlm.vision.front.EncoderFront`): its requests
to the batched model go to a real batched encoder in this process (the tiny Qwen2.5-VL tower in
ONNX Runtime behind `BatchedEncoder`), or to a fake that checks what it is sent."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.encoder_checks import rel_err
from triton_vlm.contract.messages import EncoderBatchRequest, EncoderRequest
from triton_vlm.contract.params import EncoderOptions
from triton_vlm.errors import InvalidInput
from triton_vlm.media.evs import prune
from triton_vlm.vision.batching import BatchedEncoder, EmbeddingCache, batch_items, items_from_rows
from triton_vlm.vision.front import EncoderFront


@pytest.fixture(scope="module")
def encoder(tiny_checkpoint, tmp_path_factory):
    from triton_vlm.vision.runtime.encoder import VisionEncoder
    from triton_vlm.vision.runtime.export import export_onnx

    return VisionEncoder(export_onnx(tiny_checkpoint, tmp_path_factory.mktemp("front") / "enc.onnx"))


def options(encoder, **kwargs) -> EncoderOptions:
    """The front's options as the build writes them for `encoder`'s tower."""
    tower = encoder.tower
    values = dict(batch_model="vision_encoder_batch", patch_dim=encoder.patch_dim, hidden=encoder.out_hidden,
                  spatial_merge_size=encoder.tower_merge, max_batch_patches=65536, packed_frames=tower.PACKED_FRAMES,
                  extras=",".join(tower.EXTRAS), rows=f"{tower.ROWS.__module__}:{tower.ROWS.__qualname__}",
                  tower_settings=json.dumps(encoder.settings))
    return EncoderOptions(**{**values, **kwargs})


def media(width: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel rows of an image, a 4-frame video and a small image, in prompt order."""
    grid = np.array([[1, 16, 20], [4, 8, 12], [1, 4, 4]], dtype=np.int64)
    pixels = np.random.default_rng(0).standard_normal((int(grid.prod(axis=1).sum()), width)).astype(np.float32)
    return pixels, grid


def test_shares_and_chunks_give_the_encoders_rows_in_prompt_order(encoder):
    """Over 1 to 3 batched instances and runs of at most 400 rows, the front's embeddings are the
    encoder's for the whole request; each video frame is an item of its own (the tower's frames
    are independent); neighbouring shares differ in `odd_share`; no request exceeds the limit."""
    pixels, grid = media(encoder.patch_dim)
    reference = encoder.encode(pixels, grid)
    batched = BatchedEncoder(encoder, EmbeddingCache(0))
    for shares, max_rows in ((1, 65536), (2, 65536), (3, 400)):
        sent = []

        def send(request: EncoderBatchRequest) -> np.ndarray:
            sent.append((items_from_rows(request.pixel_values, request.patch_grid).tolist(), request.odd_share))
            return batched.encode_many([batch_items(request)])[0][0]

        front = EncoderFront(options(encoder, batch_instances=shares, max_batch_patches=max_rows), send)
        out = front.encode(EncoderRequest(pixels, grid))
        assert rel_err(out.embeddings, reference) < 1e-5 and out.kept_rows.tolist() == list(range(len(reference)))
        items = [g for grids, _ in sent for g in grids]
        assert sorted(items) == sorted([[1, 16, 20]] + [[1, 8, 12]] * 4 + [[1, 4, 4]])
        assert all(sum(t * h * w for t, h, w in grids) <= max_rows for grids, _ in sent)
        assert {odd for _, odd in sent} == ({False} if shares == 1 else {False, True})


def test_video_pruning_is_evs_on_the_joined_rows(encoder):
    pixels, grid = media(encoder.patch_dim)
    front = EncoderFront(options(encoder, batch_instances=2), lambda r: encoder.encode(r.pixel_values, items_from_rows(
        r.pixel_values, r.patch_grid)))
    out = front.encode(EncoderRequest(pixels, grid, video_pruning_rate=0.5))
    rows, kept = prune(encoder.encode(pixels, grid), grid, encoder.tower_merge, 0.5)
    assert rel_err(out.embeddings, rows) < 1e-5 and out.kept_rows.tolist() == kept.tolist()
    assert len(kept) < len(encoder.encode(pixels, grid))


def test_bad_requests_name_the_input(encoder):
    pixels, grid = media(encoder.patch_dim)
    front = EncoderFront(options(encoder), lambda request: pytest.fail("a bad request reached the batched model"))
    for request, message in (
            (EncoderRequest(pixels[:-1], grid), "pixel_values: "),
            (EncoderRequest(pixels, grid[:, :2]), "grid_thw: expected shape"),
            (EncoderRequest(pixels, grid, video_pruning_rate=1.5), "video_pruning_rate must be a number in"),
            (EncoderRequest(pixels, grid, extras={"temporal_ids": np.arange(6)}), "temporal_ids: this model's vision"),
            (EncoderRequest(pixels, grid, extras={"image_sizes": np.full((3, 2), 5)}), "image_sizes: this model's")):
        with pytest.raises(InvalidInput, match=message):
            front.encode(request)
    # extras that say nothing (the contract's "none") are taken from any request
    empty = {"temporal_ids": np.full(6, -1), "image_sizes": np.zeros((3, 2), np.int64)}
    assert len(EncoderFront(options(encoder), lambda r: np.zeros((len(r.pixel_values) // 4, encoder.out_hidden),
                                                                 np.float32)).encode(EncoderRequest(
                                                                     pixels, grid, extras=empty)).embeddings)


def test_a_packing_tower_gets_its_rows_whole_with_their_extras():
    """A tower that packs frames and takes temporal ids (a resampler's `query_num` rows per grid
    row): each grid row goes whole, its frames' ids with each of its patch rows, over two shares;
    the ids go with every request, `none` where it has none."""
    grid = np.array([[3, 2, 2], [1, 2, 4], [2, 2, 2]], dtype=np.int64)
    ids = np.array([10, 11, 12, -1, 20, 21])
    pixels = np.arange(int(grid.prod(axis=1).sum()), dtype=np.float32)[:, None].repeat(6, axis=1)
    seen = []

    def send(request: EncoderBatchRequest) -> np.ndarray:
        got_pixels, got_grid, extras = batch_items(request)
        seen.append((got_grid.tolist(), extras["temporal_ids"].tolist()))
        return np.repeat(got_grid[:, :1].astype(np.float32), 2, axis=0)  # query_num = 2 rows per grid row

    front = EncoderFront(EncoderOptions(batch_model="b", patch_dim=6, hidden=1, spatial_merge_size=1,
                                        max_batch_patches=64, batch_instances=2, packed_frames=True,
                                        extras="temporal_ids", tower_settings=json.dumps({"query_num": 2})), send)
    out = front.encode(EncoderRequest(pixels, grid, extras={"temporal_ids": ids}))
    assert sorted(seen) == sorted([([[3, 2, 2]], [10, 11, 12]), ([[1, 2, 4], [2, 2, 2]], [-1, 20, 21])])
    assert out.embeddings[:, 0].tolist() == [3, 3, 1, 1, 2, 2]
    # a request without temporal ids sends them too, as none: the batcher groups like requests
    seen.clear()
    front.encode(EncoderRequest(pixels, grid))
    assert sorted(seen) == sorted([([[3, 2, 2]], [-1, -1, -1]), ([[1, 2, 4], [2, 2, 2]], [-1, -1, -1])])
