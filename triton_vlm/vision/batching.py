"""Cross-request batching and the embedding cache of the vision encoder (no Triton imports here).

Wire convention between the contract model `vision_encoder` and the internal batched model
(`vision_encoder_batch`, `max_batch_size > 0`, Triton's dynamic batcher): Triton requires every
input of a batched request to have the same first (batch) dimension and at least one row, while
the contract's `pixel_values` [N, D] and `grid_thw` [M, 3] differ in length and a text-only request
has N = 0. So the front sends one row per patch: `pixel_values` [N, D] and `patch_grid` [N, 3], the
`[t, h, w]` of the item each patch row belongs to. Items are recovered by walking the rows: the
row at an item's start names its grid, the item spans `t * h * w` rows (two adjacent items of the
same size are therefore never confused). Requests with no media never reach the batched model.
A tower that packs frames (`Tower.PACKED_FRAMES`) also gets `patch_temporal_id` [N, 1], the
temporal id of each row's frame (-1: none); its grid rows are never split into frames. A tower
that takes image sizes (`Tower.IMAGE_SIZES`) gets `patch_image_size` [N, 2], each row's item's.

Cache key: SHA-256 of an item's grid, its frames' temporal ids, its image size and its float32 pixel rows. Hashing the pixel rows (rather
than the media bytes) is exact by construction: every option that changes pixels (resize bounds,
fps, frame count, the processor config) changes the key, and nothing else does; it costs about
1 ms per 448x448 image, against the encoder's tens to thousands of ms. A hit returns the stored
array, so it is bit-identical to the first computation.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from triton_vlm.errors import InvalidInput


class EmbeddingCache:
    """LRU of item embeddings bounded in bytes (`capacity_bytes` 0 disables it). Thread-safe."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = int(capacity_bytes)
        self.used = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> np.ndarray | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: bytes, value: np.ndarray) -> None:
        size = value.nbytes
        if size > self.capacity:
            return
        value = np.array(value, dtype=np.float32, copy=True)
        value.flags.writeable = False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.used -= old.nbytes
            self._entries[key] = value
            self.used += size
            while self.used > self.capacity:
                _, evicted = self._entries.popitem(last=False)
                self.used -= evicted.nbytes


def item_key(pixels: np.ndarray, grid_row, temporal_ids: np.ndarray | None = None,
             image_size: np.ndarray | None = None) -> bytes:
    digest = hashlib.sha256(np.asarray(grid_row, dtype=np.int64).tobytes())
    if temporal_ids is not None:
        digest.update(b"temporal" + np.asarray(temporal_ids, dtype=np.int64).tobytes())
    if image_size is not None:
        digest.update(b"size" + np.asarray(image_size, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(pixels, dtype=np.float32).data)
    return digest.digest()


def patch_grid(grid_thw: np.ndarray) -> np.ndarray:
    """The per-row grid [N, 3] of the wire convention for `grid_thw` [M, 3]."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return np.repeat(grid, grid.prod(axis=1), axis=0)


def patch_temporal_ids(grid_thw: np.ndarray, temporal_ids: np.ndarray | None) -> np.ndarray:
    """int64 [N]: each patch row's frame's temporal id (one per frame of `grid_thw`; None: -1)."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    frames = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
    ids = np.full(len(frames), -1, np.int64) if temporal_ids is None else np.asarray(temporal_ids, np.int64)
    return np.repeat(ids, frames)


def frames_from_rows(rows_temporal: np.ndarray, grid_thw: np.ndarray) -> np.ndarray:
    """One temporal id per frame back from the per-row ids (`patch_temporal_ids`); raises
    InvalidInput if a frame's rows disagree."""
    rows = np.asarray(rows_temporal).reshape(-1)
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    frames = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
    if len(rows) != int(frames.sum()):
        raise InvalidInput(f"patch_temporal_id: expected {int(frames.sum())} rows, got {len(rows)}")
    starts = offsets(frames)[:-1]
    ids = rows[starts].astype(np.int64)
    if (np.repeat(ids, frames) != rows).any():
        raise InvalidInput("patch_temporal_id: the rows of a frame disagree")
    return ids


def patch_image_sizes(grid_thw: np.ndarray, image_sizes: np.ndarray) -> np.ndarray:
    """int64 [N, 2]: each patch row's item's image size (one per row of `grid_thw`)."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return np.repeat(np.asarray(image_sizes, np.int64).reshape(-1, 2), grid.prod(axis=1), axis=0)


def items_from_row_sizes(rows_sizes: np.ndarray, grid_thw: np.ndarray) -> np.ndarray:
    """One image size per item back from the per-row sizes (`patch_image_sizes`); raises
    InvalidInput if an item's rows disagree."""
    rows = np.asarray(rows_sizes)
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    counts = grid.prod(axis=1)
    if rows.shape != (int(counts.sum()), 2) or not np.issubdtype(rows.dtype, np.integer):
        raise InvalidInput(f"patch_image_size: expected int64 [{int(counts.sum())}, 2], got {list(rows.shape)}")
    sizes = rows[offsets(counts)[:-1]].astype(np.int64)
    if (np.repeat(sizes, counts, axis=0) != rows).any():
        raise InvalidInput("patch_image_size: the rows of an item disagree")
    return sizes


def items_from_rows(pixels: np.ndarray, rows_grid: np.ndarray) -> np.ndarray:
    """`grid_thw` [M, 3] back from the per-row grid; raises InvalidInput if the rows disagree."""
    rows_grid = np.asarray(rows_grid)
    if rows_grid.ndim != 2 or rows_grid.shape[1] != 3 or len(rows_grid) != len(pixels):
        raise InvalidInput(f"patch_grid: expected shape [{len(pixels)}, 3], got {list(rows_grid.shape)}")
    grids, row = [], 0
    while row < len(rows_grid):
        t, h, w = (int(v) for v in rows_grid[row])
        n = t * h * w
        if t <= 0 or h <= 0 or w <= 0 or row + n > len(rows_grid) or (rows_grid[row:row + n] != rows_grid[row]).any():
            raise InvalidInput(f"patch_grid: rows from {row} do not describe one item of grid [{t}, {h}, {w}]")
        grids.append((t, h, w))
        row += n
    return np.array(grids, dtype=np.int64).reshape(-1, 3)


def chunk_items(grid_thw: np.ndarray, max_rows: int) -> list[tuple[int, int]]:
    """Split items into consecutive runs of at most `max_rows` patches: (first item, end item)."""
    sizes = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3).prod(axis=1)
    runs, start, rows = [], 0, 0
    for i, n in enumerate(sizes.tolist()):
        if n > max_rows:
            raise InvalidInput(f"grid_thw[{i}]: {n} patches exceed the encoder's max_batch_patches={max_rows}")
        if rows + n > max_rows:
            runs.append((start, i))
            start, rows = i, 0
        rows += n
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs


def offsets(counts) -> np.ndarray:
    """int64 [len(counts) + 1]: where each of consecutive runs of `counts` rows starts, and the end."""
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def encode_in_shares(pixels: np.ndarray, grid_thw: np.ndarray, send: Callable[..., np.ndarray], *, shares: int,
                     max_rows: int, hidden: int, rows_per_item: np.ndarray,
                     rows_temporal: np.ndarray | None = None, rows_sizes: np.ndarray | None = None) -> np.ndarray:
    """Embeddings of the items of `grid_thw` (their patch rows `pixels`; `rows_per_item`: the
    embedding rows each gives, `Tower.embedding_rows`), in item order: the items
    split over `shares` encoder instances (`balance_items`), the shares sent at once, each in
    requests of at most `max_rows` rows (`chunk_items`); `send(pixels, grid, rows_temporal,
    odd_share)` is one request, `rows_temporal` the per-row temporal ids (`patch_temporal_ids`)
    of its rows where given, else None; with `rows_sizes` (`patch_image_sizes`), their slice follows
    as a fifth argument. Odd shares are sent with `odd_share` true: Triton's
    dynamic batcher never puts requests with different inputs in one execution, so two
    neighbouring shares run as two executions, on two instances when both are free."""
    from concurrent.futures import ThreadPoolExecutor

    rows = offsets(grid_thw.prod(axis=1))

    def take(values: np.ndarray | None, items: np.ndarray) -> np.ndarray | None:
        if values is None or len(items) == len(grid_thw):
            return values
        return np.concatenate([values[rows[i]:rows[i + 1]] for i in items.tolist()], axis=0)

    def encode(items: np.ndarray, odd_share: bool) -> np.ndarray:
        share_pixels, share_temporal, share_sizes = take(pixels, items), take(rows_temporal, items), take(rows_sizes, items)
        share_grid, share_rows = grid_thw[items], offsets(grid_thw[items].prod(axis=1))
        parts = []
        for first, end in chunk_items(share_grid, max_rows):
            a, b = share_rows[first], share_rows[end]
            sizes = () if share_sizes is None else (share_sizes[a:b],)
            parts.append(send(share_pixels[a:b], share_grid[first:end],
                              None if share_temporal is None else share_temporal[a:b], odd_share, *sizes))
        if len(parts) == 1:  # the common case: no copy
            return parts[0]
        return np.concatenate(parts, axis=0) if parts else np.zeros((0, hidden), np.float32)

    split = balance_items(grid_thw, shares)
    if len(split) <= 1:  # one instance, one item, or none (text only)
        return encode(np.arange(len(grid_thw)), False)
    with ThreadPoolExecutor(len(split)) as pool:
        embeddings = list(pool.map(encode, split, [k % 2 == 1 for k in range(len(split))]))
    return join_shares(split, embeddings, rows_per_item)


def embedding_rows(grid_thw: np.ndarray, merge: int, query_num: int = 0, extra_rows: int = 0) -> np.ndarray:
    """Embedding rows of each grid row: `query_num` (a resampler's learned queries, whatever the
    row's size), or with none one per merge^2 patches plus `extra_rows` per frame (LLaVA: its
    class token kept, +1, or its first token dropped, -1)."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    if query_num:
        return np.full(len(grid), query_num, dtype=np.int64)
    return grid.prod(axis=1) // merge ** 2 + extra_rows * grid[:, 0]


def balance_items(grid_thw: np.ndarray, shares: int) -> list[np.ndarray]:
    """The items of `grid_thw` split over `shares` encoder instances by patch count, as vLLM's
    `get_load_balance_assignment` does (largest item first, each to the least loaded share, the
    first of equals): item indices per non-empty share, each in item order."""
    sizes = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3).prod(axis=1).tolist()
    loads, assigned = [0] * max(1, shares), [[] for _ in range(max(1, shares))]
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        share = loads.index(min(loads))
        assigned[share].append(i)
        loads[share] += sizes[i]
    return [np.array(sorted(items), dtype=np.int64) for items in assigned if items]


def join_shares(shares: list[np.ndarray], embeddings: list[np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """The embeddings of every item in item order, from each share's (`balance_items`) embeddings of
    its own items; `tokens`: embedding rows per item."""
    starts = offsets(tokens)
    out = np.empty((int(starts[-1]), embeddings[0].shape[1]), dtype=np.float32)
    for items, emb in zip(shares, embeddings):
        row = 0
        for i in items.tolist():
            out[starts[i]:starts[i + 1]] = emb[row:row + tokens[i]]
            row += tokens[i]
    return out


@dataclass
class BatchStats:
    requests: int = 0
    items: int = 0
    hits: int = 0
    misses: int = 0


class BatchedEncoder:
    """Encodes the media items of many requests in one go, each distinct item once.

    `encoder` is anything with `encode(pixels, grid, temporal_ids) -> embeddings` and
    `embedding_rows(grid)` (a `TowerEncoder`; with `image_sizes` too where a request has them). Items already in `cache` (or repeated within the
    batch) are not computed again; the others are encoded together in one call, which groups them
    by size.
    """

    def __init__(self, encoder, cache: EmbeddingCache) -> None:
        self.encoder, self.cache = encoder, cache

    def encode_many(self, batch: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]
                    ) -> tuple[list[np.ndarray], BatchStats]:
        """`batch`: (pixel_values [N, D], grid_thw [M, 3], temporal ids [frames] or None[, image
        sizes [M, 2] or None]) per request, already validated. Returns each request's embeddings [tokens, hidden] and the
        counts."""
        stats = BatchStats(requests=len(batch))
        per_request: list[list[bytes]] = []
        found: dict[bytes, np.ndarray] = {}
        todo: dict[bytes, tuple[np.ndarray, tuple[int, int, int], np.ndarray | None]] = {}
        sizes_of: dict[bytes, np.ndarray] = {}
        for pixels, grid, temporal_ids, *image_sizes in batch:
            keys, row, frame = [], 0, 0
            image_sizes = image_sizes[0] if image_sizes else None
            for k, (t, h, w) in enumerate(grid.tolist()):
                n = t * h * w
                ids = None if temporal_ids is None else temporal_ids[frame:frame + t]
                size = None if image_sizes is None else image_sizes[k]
                key = item_key(pixels[row:row + n], (t, h, w), ids, size)
                if size is not None:
                    sizes_of[key] = size
                row, frame = row + n, frame + t
                keys.append(key)
                stats.items += 1
                if key in found or key in todo:
                    stats.hits += 1
                    continue
                cached = self.cache.get(key)
                if cached is not None:
                    found[key] = cached
                    stats.hits += 1
                else:
                    todo[key] = (pixels[row - n:row], (t, h, w), ids)
                    stats.misses += 1
            per_request.append(keys)
        if todo:
            grids = np.array([g for _, g, _ in todo.values()], dtype=np.int64)
            rows = [p for p, _, _ in todo.values()]  # one item (the usual request): its rows as they are
            temporal = [i if i is not None else np.full(g[0], -1, np.int64) for _, g, i in todo.values()]
            sizes = () if not sizes_of else (np.array([sizes_of.get(key, (0, 0)) for key in todo], np.int64),)
            emb = self.encoder.encode(rows[0] if len(rows) == 1 else np.concatenate(rows, axis=0), grids,
                                      np.concatenate(temporal), *sizes)
            row = 0
            for key, k in zip(todo, self.encoder.embedding_rows(grids, *sizes).tolist()):
                found[key] = emb[row:row + k]
                self.cache.put(key, found[key])
                row += k
        self.cache.hits += stats.hits
        self.cache.misses += stats.misses
        outputs = []
        for keys in per_request:
            parts = [found[k] for k in keys]
            outputs.append(np.concatenate(parts, axis=0) if len(parts) != 1 else np.array(parts[0], copy=True))
        return outputs, stats
