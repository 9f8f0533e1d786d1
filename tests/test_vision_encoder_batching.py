"""Cross-request batching and the embedding cache (no server): triton_vlm.vision.batching.

Parity is against the Hugging Face vision tower of the tiny checkpoint, computed in this run.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.encoder_checks import rel_err
from triton_vlm.contract.messages import EncoderBatchRequest
from triton_vlm.contract.tensors import EXTRA
from triton_vlm.errors import InvalidInput
from triton_vlm.vision import batching as b


def request(grid, width, seed):
    """(pixel rows, grid_thw, extras: none) of a `BatchedEncoder.encode_many` request."""
    grid = np.array(grid, dtype=np.int64).reshape(-1, 3)
    rng = np.random.default_rng(seed)
    return rng.standard_normal((int(grid.prod(1).sum()), width)).astype(np.float32), grid, {}


@pytest.fixture(scope="module")
def encoder(tiny_checkpoint, tmp_path_factory):
    from triton_vlm.vision.runtime.encoder import VisionEncoder
    from triton_vlm.vision.runtime.export import export_onnx

    return VisionEncoder(export_onnx(tiny_checkpoint, tmp_path_factory.mktemp("batching") / "enc.onnx"))


def hf_tower(hf, pixels, grid):
    with torch.no_grad():
        return hf.model.model.visual(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grid)).pooler_output.numpy()


def test_patch_grid_round_trip_keeps_adjacent_items_of_one_size_apart():
    grid = np.array([[1, 4, 6], [1, 4, 6], [2, 2, 2], [1, 4, 6]])
    rows = b.patch_grid(grid)
    assert rows.shape == (24 + 24 + 8 + 24, 3)
    np.testing.assert_array_equal(b.items_from_rows(np.zeros((len(rows), 1)), rows), grid)


@pytest.mark.parametrize("rows, match", [
    (np.array([[1, 2, 2]] * 3), "patch_grid"),                      # item needs 4 rows, 3 given
    (np.array([[1, 2, 2]] * 3 + [[1, 2, 4]]), "patch_grid"),        # rows of one item disagree
    (np.array([[0, 2, 2]] * 4), "patch_grid"),
    (np.array([[1, 2, 2, 1]] * 4), "patch_grid"),
])
def test_items_from_rows_rejects_inconsistent_rows(rows, match):
    with pytest.raises(InvalidInput, match=match):
        b.items_from_rows(np.zeros((len(rows), 1)), rows)


def test_chunk_items():
    grid = np.array([[1, 4, 4], [1, 4, 4], [1, 2, 2], [1, 8, 8]])  # 16, 16, 4, 64 patches
    assert b.chunk_items(grid, 64) == [(0, 3), (3, 4)]
    assert b.chunk_items(grid, 1000) == [(0, 4)]
    assert b.chunk_items(np.zeros((0, 3)), 64) == []
    with pytest.raises(InvalidInput, match=r"grid_thw\[3\]: 64 patches exceed"):
        b.chunk_items(grid, 32)


def test_cache_is_an_lru_bounded_in_bytes():
    entry = np.ones((4, 8), np.float32)  # 128 bytes
    cache = b.EmbeddingCache(3 * entry.nbytes)
    for k in (b"a", b"b", b"c"):
        cache.put(k, entry * ord(k))
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"d", entry)
    assert cache.get(b"b") is None and len(cache) == 3 and cache.used == 3 * entry.nbytes
    assert cache.get(b"a") is not None and cache.get(b"c") is not None
    cache.put(b"big", np.ones((100, 8), np.float32))  # larger than the whole cache: not stored
    assert cache.get(b"big") is None and cache.used == 3 * entry.nbytes
    off = b.EmbeddingCache(0)
    off.put(b"a", entry)
    assert off.get(b"a") is None
    stored = cache.get(b"a")
    with pytest.raises(ValueError):
        stored[0, 0] = 0  # read-only: a caller cannot corrupt later hits


def test_cache_key_covers_grid_and_every_pixel():
    pixels = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    key = b.item_key(pixels, (1, 4, 4))
    assert key == b.item_key(pixels.copy(), (1, 4, 4))
    assert key != b.item_key(pixels, (1, 2, 8))
    changed = pixels.copy()
    changed[15, 7] = np.nextafter(changed[15, 7], np.float32(np.inf))
    assert key != b.item_key(changed, (1, 4, 4))


def test_batch_of_requests_equals_hf_per_request(encoder, hf):
    width = encoder.patch_dim
    batch = [request([[1, 34, 46]], width, 1),                 # partial windows
             request([[1, 16, 16], [2, 8, 12], [1, 4, 6]], width, 2),  # image, video, small image
             request([[2, 20, 28]], width, 3)]                 # video only
    outputs, stats = b.BatchedEncoder(encoder, b.EmbeddingCache(0)).encode_many(batch)
    assert stats.requests == 3 and stats.items == 5 and stats.misses == 5 and stats.hits == 0
    for (pixels, grid, _), out in zip(batch, outputs):
        assert out.dtype == np.float32
        assert rel_err(out, hf_tower(hf, pixels, grid)) < 1e-4


def test_same_item_in_one_batch_and_later_is_computed_once_and_bit_identical(encoder, hf):
    width = encoder.patch_dim
    image = request([[1, 22, 36]], width, 7)
    other = request([[1, 8, 8]], width, 8)
    both = (np.concatenate([image[0], other[0]]), np.concatenate([image[1], other[1]]), {})
    cache = b.EmbeddingCache(1 << 20)
    calls = []

    class Counting:
        embedding_rows = staticmethod(encoder.embedding_rows)

        def encode(self, pixels, grid, extras):
            calls.append(grid.tolist())
            return encoder.encode(pixels, grid, extras)

    batched = b.BatchedEncoder(Counting(), cache)
    (first, second, third), stats = batched.encode_many([image, image, both])
    assert calls == [[[1, 22, 36], [1, 8, 8]]]  # each distinct item once
    assert stats.misses == 2 and stats.hits == 2 and (cache.hits, cache.misses) == (2, 2)
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(third[:len(first)], first)
    assert rel_err(first, hf_tower(hf, *image[:2])) < 1e-4
    (again,), stats = batched.encode_many([image])
    assert len(calls) == 1 and stats.hits == 1 and stats.misses == 0
    assert again.tobytes() == first.tobytes()  # a hit is bit-identical
    again[0, 0] += 1  # a response is the caller's own copy
    (after,), _ = batched.encode_many([image])
    assert after.tobytes() == first.tobytes()


def test_balance_items_is_vllms_greedy_split_and_join_restores_item_order():
    grid = np.array([[1, 2, 4], [1, 8, 8], [1, 4, 4], [1, 2, 2], [1, 4, 4]])  # 8, 64, 16, 4, 16 patches
    shares = b.balance_items(grid, 2)
    assert [s.tolist() for s in shares] == [[1], [0, 2, 3, 4]]  # 64 against 44
    assert [s.tolist() for s in b.balance_items(grid, 3)] == [[1], [0, 2], [3, 4]]  # 64, 24, 20
    assert [s.tolist() for s in b.balance_items(grid, 1)] == [[0, 1, 2, 3, 4]]
    assert b.balance_items(grid[:1], 4) == [np.array([0])] and b.balance_items(np.zeros((0, 3)), 2) == []
    tokens = grid.prod(axis=1) // 4
    full = np.arange(int(tokens.sum()), dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    starts = np.concatenate([[0], np.cumsum(tokens)])
    parts = [np.concatenate([full[starts[i]:starts[i + 1]] for i in s]) for s in shares]
    np.testing.assert_array_equal(b.join_shares(shares, parts, tokens), full)


def test_encode_in_shares_splits_chunks_and_joins_in_item_order():
    """`encode_in_shares` (the `vision_encoder` front's orchestration) with a fake encoder that
    embeds each row as its patch index: every split gives the one-instance result, each request
    holds at most `max_rows` rows, odd shares are flagged."""
    grid = np.array([[1, 4, 4], [1, 8, 8], [1, 2, 4], [1, 4, 6], [1, 2, 2]])
    pixels = np.arange(int(grid.prod(axis=1).sum()), dtype=np.float32)[:, None].repeat(3, axis=1)
    sent = []

    def send(request: EncoderBatchRequest) -> np.ndarray:
        rows = request.pixel_values
        sent.append((len(rows), request.odd_share))
        assert len(rows) == len(request.patch_grid) == int(b.items_from_rows(rows, request.patch_grid).prod(axis=1).sum())
        if "temporal_ids" in request.patch_extras:  # each row's temporal id is its patch index, as its pixels
            np.testing.assert_array_equal(request.patch_extras["temporal_ids"][:, 0], rows[:, 0])
        return rows[::4, :2]  # one "token" per 2x2 merge unit: its first row

    tokens = grid.prod(axis=1) // 4
    one = b.encode_in_shares(pixels, grid, send, shares=1, max_rows=1000, hidden=2, rows_per_item=tokens)
    assert sent == [(len(pixels), False)]
    for shares, max_rows in ((2, 1000), (3, 64), (2, 80)):
        sent.clear()
        out = b.encode_in_shares(pixels, grid, send, shares=shares, max_rows=max_rows, hidden=2, rows_per_item=tokens)
        np.testing.assert_array_equal(out, one)
        assert all(n <= max_rows for n, _ in sent) and {odd for _, odd in sent} == {False, True}
        rows_temporal = np.arange(len(pixels), dtype=np.int64)[:, None]  # sliced with the pixel rows
        np.testing.assert_array_equal(b.encode_in_shares(pixels, grid, send, shares=shares, max_rows=max_rows, hidden=2,
                                                         rows_per_item=tokens,
                                                         patch_extras={"temporal_ids": rows_temporal}), one)
    assert b.encode_in_shares(pixels[:0], grid[:0], send, shares=2, max_rows=64, hidden=2,
                              rows_per_item=tokens[:0]).shape == (0, 2)


def test_temporal_ids_travel_per_row_and_are_checked():
    """A packed tower's temporal ids (a per-frame extra): one per frame on the contract
    (`ItemExtra.check`), one per patch row to the batched model (`ItemExtra.rows`) and back
    (`ItemExtra.from_rows`)."""
    extra = EXTRA["temporal_ids"]
    grid = np.array([[3, 2, 2], [1, 2, 4]])
    ids = np.array([1, 5, 8, -1])
    rows = extra.rows(ids, grid)
    assert rows[:, 0].tolist() == [1] * 4 + [5] * 4 + [8] * 4 + [-1] * 8
    np.testing.assert_array_equal(extra.from_rows(rows, grid), ids)
    rows[5] = 6
    with pytest.raises(InvalidInput, match=r"^patch_temporal_id: the rows of a frame disagree$"):
        extra.from_rows(rows, grid)
    assert extra.rows(None, grid)[:, 0].tolist() == [-1] * 20
    np.testing.assert_array_equal(extra.check(ids, grid, taken=True), ids)
    assert extra.check(np.full(4, -1), grid, taken=False) is None
    assert extra.check(None, grid, taken=True) is None
    for bad, taken, message in ((ids[:3], True, r"expected shape \[4\]"), (ids.astype(np.float32), True, "expected integers"),
                                (np.array([1, 5, 8, -2]), True, r"values must lie in \[-1, 2147483647\]$"),
                                (ids, False, "this model.s vision tower takes none")):
        with pytest.raises(InvalidInput, match=r"^temporal_ids: " + message):
            extra.check(bad, grid, taken)


def test_image_sizes_travel_per_row_and_are_checked():
    """An image's size (a per-grid-row extra): one per grid row on the contract, one per patch row
    to the batched model and back; zeros say nothing."""
    extra = EXTRA["image_sizes"]
    grid = np.array([[2, 2, 2], [1, 2, 4]])
    sizes = np.array([[480, 640], [0, 0]])
    rows = extra.rows(sizes, grid)
    assert rows.tolist() == [[480, 640]] * 8 + [[0, 0]] * 8
    np.testing.assert_array_equal(extra.from_rows(rows, grid), sizes)
    rows[3] = (480, 641)
    with pytest.raises(InvalidInput, match=r"^patch_image_size: the rows of an item disagree$"):
        extra.from_rows(rows, grid)
    assert extra.check(np.zeros((2, 2), np.int64), grid, taken=False) is None
    for bad, message in ((sizes[:1], r"expected shape \[2, 2\]"), (-sizes, r"values must lie in \[0, 2147483647\]$"),
                         (sizes, "this model.s vision tower takes none")):
        with pytest.raises(InvalidInput, match=r"^image_sizes: " + message):
            extra.check(bad, grid, taken=False)
