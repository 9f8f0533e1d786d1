"""Cross-request batching and the embedding cache of the vision encoder (no Triton imports here).

Wire convention between the contract model `vision_encoder` and the internal batched model
(`vision_encoder_batch`, `max_batch_size > 0`, Triton's dynamic batcher): Triton requires every
input of a batched request to have the same first (batch) dimension and at least one row, while
the contract's `pixel_values` [N, D] and `grid_thw` [M, 3] differ in length and a text-only request
has N = 0. So the front sends one row per patch (`EncoderBatchRequest`): `pixel_values` [N, D]
and `patch_grid` [N, 3], the `[t, h, w]` of the item each patch row belongs to. Items are
recovered by walking the rows: the row at an item's start names its grid, the item spans
`t * h * w` rows (two adjacent items of the same size are therefore never confused). Requests with
no media never reach the batched model. A request's per-item extras (`contract.tensors.EXTRAS`)
go the same way, one row per patch (`ItemExtra.rows`, back by `ItemExtra.from_rows`).

Cache key: SHA-256 of an item's grid, its extras and its float32 pixel rows. Hashing the pixel rows (rather
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
from typing import Callable, Mapping

import numpy as np

from triton_vlm.contract.messages import EncoderBatchRequest
from triton_vlm.contract.tensors import EXTRA
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


def item_key(pixels: np.ndarray, grid_row, extras: Mapping[str, np.ndarray] | None = None) -> bytes:
    digest = hashlib.sha256(np.asarray(grid_row, dtype=np.int64).tobytes())
    for name, value in sorted((extras or {}).items()):
        digest.update(name.encode() + np.asarray(value, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(pixels, dtype=np.float32).data)
    return digest.digest()


def patch_grid(grid_thw: np.ndarray) -> np.ndarray:
    """The per-row grid [N, 3] of the wire convention for `grid_thw` [M, 3]."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return np.repeat(grid, grid.prod(axis=1), axis=0)


def batch_items(request: EncoderBatchRequest) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """A batched request's (pixel rows float32 [N, D], grid_thw [M, 3], extras by name) back from its
    rows; InvalidInput naming the input whose rows disagree."""
    grid = items_from_rows(request.pixel_values, request.patch_grid)
    extras = {name: EXTRA[name].from_rows(rows, grid) for name, rows in request.patch_extras.items()}
    return np.asarray(request.pixel_values, dtype=np.float32), grid, extras


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


def encode_in_shares(pixels: np.ndarray, grid_thw: np.ndarray, send: Callable[[EncoderBatchRequest], np.ndarray], *,
                     shares: int, max_rows: int, hidden: int, rows_per_item: np.ndarray,
                     patch_extras: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """Embeddings of the items of `grid_thw` (their patch rows `pixels`; `rows_per_item`: the
    embedding rows each gives, `Tower.embedding_rows`), in item order: the items split over
    `shares` encoder instances (`balance_items`), the shares sent at once, each in requests of at
    most `max_rows` rows (`chunk_items`); `send(request)` is one request to the batched model, with
    its rows' slice of `patch_extras` (each extra's per-row values, `ItemExtra.rows`). Odd shares
    are sent with `odd_share` true: Triton's dynamic batcher never puts requests with different
    inputs in one execution, so two neighbouring shares run as two executions, on two instances
    when both are free."""
    from concurrent.futures import ThreadPoolExecutor

    rows = offsets(grid_thw.prod(axis=1))
    patch_extras = dict(patch_extras or {})

    def take(values: np.ndarray, items: np.ndarray) -> np.ndarray:
        if len(items) == len(grid_thw):
            return values
        return np.concatenate([values[rows[i]:rows[i + 1]] for i in items.tolist()], axis=0)

    def encode(items: np.ndarray, odd_share: bool) -> np.ndarray:
        share_pixels = take(pixels, items)
        share_extras = {name: take(values, items) for name, values in patch_extras.items()}
        share_grid, share_rows = grid_thw[items], offsets(grid_thw[items].prod(axis=1))
        parts = []
        for first, end in chunk_items(share_grid, max_rows):
            a, b = share_rows[first], share_rows[end]
            parts.append(send(EncoderBatchRequest(share_pixels[a:b], patch_grid(share_grid[first:end]), odd_share,
                                                  {name: values[a:b] for name, values in share_extras.items()})))
        if len(parts) == 1:  # the common case: no copy
            return parts[0]
        return np.concatenate(parts, axis=0) if parts else np.zeros((0, hidden), np.float32)

    split = balance_items(grid_thw, shares)
    if len(split) <= 1:  # one instance, one item, or none (text only)
        return encode(np.arange(len(grid_thw)), False)
    with ThreadPoolExecutor(len(split)) as pool:
        embeddings = list(pool.map(encode, split, [k % 2 == 1 for k in range(len(split))]))
    return join_shares(split, embeddings, rows_per_item)


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

    `encoder` is anything with `encode(pixels, grid, extras) -> embeddings` and
    `embedding_rows(grid, extras)` (a `TowerEncoder`). Items already in `cache` (or repeated
    within the batch) are not computed again; the others are encoded together in one call, which
    groups them by size.
    """

    def __init__(self, encoder, cache: EmbeddingCache) -> None:
        self.encoder, self.cache = encoder, cache

    def encode_many(self, batch: list[tuple[np.ndarray, np.ndarray, Mapping[str, np.ndarray]]]
                    ) -> tuple[list[np.ndarray], BatchStats]:
        """`batch`: (pixel_values [N, D], grid_thw [M, 3], extras by name) per request, already
        validated. Returns each request's embeddings [tokens, hidden] and the counts."""
        stats = BatchStats(requests=len(batch))
        per_request: list[list[bytes]] = []
        found: dict[bytes, np.ndarray] = {}
        todo: dict[bytes, tuple[np.ndarray, tuple[int, int, int], dict[str, np.ndarray]]] = {}
        for pixels, grid, extras in batch:
            keys, row, frame = [], 0, 0
            for k, (t, h, w) in enumerate(grid.tolist()):
                n = t * h * w
                item_extras = {name: EXTRA[name].item(value, k, frame, t) for name, value in extras.items()}
                key = item_key(pixels[row:row + n], (t, h, w), item_extras)
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
                    todo[key] = (pixels[row - n:row], (t, h, w), item_extras)
                    stats.misses += 1
            per_request.append(keys)
        if todo:
            grids = np.array([g for _, g, _ in todo.values()], dtype=np.int64)
            rows = [p for p, _, _ in todo.values()]  # one item (the usual request): its rows as they are
            names = sorted({name for _, _, e in todo.values() for name in e})
            extras = {name: np.concatenate([e[name] if name in e else EXTRA[name].empty([g])
                                            for _, g, e in todo.values()]) for name in names}
            emb = self.encoder.encode(rows[0] if len(rows) == 1 else np.concatenate(rows, axis=0), grids, extras)
            row = 0
            for key, k in zip(todo, self.encoder.embedding_rows(grids, extras).tolist()):
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
