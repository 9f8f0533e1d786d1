"""A typed message per step, made of the contract's tensors (`tensors`): what each model reads from
its request and writes into its response, free of Triton.

A message is read from a request's inputs by name (`from_inputs(get)`, `get(name)` an array or
None), with InvalidInput naming a missing or malformed input, and written as arrays by name
(`to_tensors()`), each cast to its spec. The Python-backend adapters (`triton_vlm.serving.backend`)
only move these arrays in and out of Triton's tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from triton_vlm.contract.tensors import (EXTRA, EXTRAS, GRID_THW, ODD_SHARE, PATCH_GRID, PREPROCESS_OUTPUTS, TensorSpec,
                                         encoder_outputs)
from triton_vlm.errors import InvalidInput

Get = Callable[[str], "np.ndarray | None"]


def required(get: Get, name: str) -> np.ndarray:
    value = get(name)
    if value is None:
        raise InvalidInput(f"{name}: required input is missing")
    return value


def text(get: Get, name: str) -> str | None:
    """A BYTES [1] input as UTF-8 text; None when absent or empty."""
    value = get(name)
    if value is None or value.size == 0:
        return None
    try:
        return bytes(value.reshape(-1)[0]).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"{name}: not valid UTF-8") from None


def items(get: Get, name: str) -> list[bytes]:
    """A BYTES [-1] input's items."""
    value = get(name)
    return [] if value is None else [bytes(v) for v in value.reshape(-1)]


def scalar(get: Get, name: str, kind: Callable):
    """A [1] input's one value as `kind`; None when absent."""
    value = get(name)
    if value is None:
        return None
    if value.size != 1:
        raise InvalidInput(f"{name}: expected one value, got {value.size}")
    return kind(value.reshape(-1)[0])


def write(specs: tuple[TensorSpec, ...], values: Mapping[str, object]) -> dict[str, np.ndarray]:
    """`values` as the arrays of `specs` (a value that is None is left out)."""
    return {spec.name: spec.array(values[spec.name]) for spec in specs if values.get(spec.name) is not None}


# ---- preprocess -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PreprocessRequest:
    text_input: str
    images: list[bytes] = field(default_factory=list)
    videos: list[bytes] = field(default_factory=list)
    mm_options: str | None = None

    @classmethod
    def from_inputs(cls, get: Get) -> PreprocessRequest:
        prompt = text(get, "text_input")
        if prompt is None:
            raise InvalidInput("text_input: required input is missing")
        return cls(prompt, items(get, "images"), items(get, "videos"), text(get, "mm_options"))


@dataclass
class PreprocessOutput:
    input_ids: np.ndarray            # int32 [S]
    pixel_values: np.ndarray         # float32 [N, D]
    grid_thw: np.ndarray             # int64 [M, 3], prompt order
    mrope_position_ids: np.ndarray   # int64 [3, S]
    mrope_position_delta: int
    # With EVS pruning on (`video_pruning_rate` > 0): the unpruned positions of every media token,
    # prompt order, int64 [3, U]; the llm puts the kept ones' into `mrope_position_ids` (see
    # `triton_vlm.media.mrope.complete_positions`). Zero columns when pruning is off.
    media_position_ids: np.ndarray = field(default_factory=lambda: np.zeros((3, 0), np.int64))
    video_pruning_rate: float = 0.0
    # Each of `EXTRAS` by name, for every frame (grid row) of `grid_thw`; `none` where it says nothing.
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.extras = {extra.name: self.extras.get(extra.name, extra.empty(self.grid_thw)) for extra in EXTRAS}

    @property
    def temporal_ids(self) -> np.ndarray:
        return self.extras["temporal_ids"]

    @property
    def image_sizes(self) -> np.ndarray:
        return self.extras["image_sizes"]

    def to_tensors(self) -> dict[str, np.ndarray]:
        return write(PREPROCESS_OUTPUTS, {**vars(self), **self.extras})


# ---- vision_encoder ----------------------------------------------------------------------------
@dataclass(frozen=True)
class EncoderRequest:
    pixel_values: np.ndarray
    grid_thw: np.ndarray
    video_pruning_rate: float = 0.0
    extras: dict[str, np.ndarray | None] = field(default_factory=dict)  # as given: checked by the front

    @classmethod
    def from_inputs(cls, get: Get) -> EncoderRequest:
        return cls(required(get, "pixel_values"), required(get, GRID_THW.name),
                   scalar(get, "video_pruning_rate", float) or 0.0, {extra.name: get(extra.name) for extra in EXTRAS})


def check_media(pixel_values, grid_thw, patch_dim: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """The contract's `pixel_values` [N, patch_dim] / `grid_thw` [M, 3] checked; InvalidInput names
    the input."""
    grid = np.asarray(grid_thw)
    if grid.size == 0:
        grid = grid.reshape(0, 3)
    if grid.ndim != 2 or grid.shape[1] != 3:
        raise InvalidInput(f"grid_thw: expected shape [items, 3], got {list(grid.shape)}")
    if not np.issubdtype(grid.dtype, np.integer):
        raise InvalidInput(f"grid_thw: expected integers, got {grid.dtype}")
    grid = grid.astype(np.int64)
    for i, (t, h, w) in enumerate(grid.tolist()):
        if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
            raise InvalidInput(f"grid_thw[{i}]: [{t}, {h}, {w}] must be positive with h and w "
                               f"multiples of {merge}")
    pixels = np.asarray(pixel_values)
    if pixels.ndim != 2:
        raise InvalidInput(f"pixel_values: expected shape [patches, {patch_dim}], got {list(pixels.shape)}")
    expected = int(grid.prod(axis=1).sum())
    if pixels.shape[0] != expected:
        raise InvalidInput(f"pixel_values: {pixels.shape[0]} rows, but grid_thw describes {expected} patches")
    if expected and pixels.shape[1] != patch_dim:
        raise InvalidInput(f"pixel_values: rows are {pixels.shape[1]} wide, expected {patch_dim}")
    if expected and not np.issubdtype(pixels.dtype, np.floating):
        raise InvalidInput(f"pixel_values: expected floating point, got {pixels.dtype}")
    return pixels, grid


def check_extras(extras: Mapping[str, np.ndarray | None] | None, grid: np.ndarray,
                 takes: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The given extras that say something (`ItemExtra.check`: each checked against `grid`, refused
    unless the tower `takes` it), by name."""
    extras = extras or {}
    unknown = set(extras) - set(EXTRA)
    if unknown:
        raise ValueError(f"unknown extras {sorted(unknown)}; the contract's: {', '.join(EXTRA)}")
    checked = {name: EXTRA[name].check(value, grid, name in takes) for name, value in extras.items()}
    return {name: value for name, value in checked.items() if value is not None}


@dataclass(frozen=True)
class EncoderOutput:
    embeddings: np.ndarray  # float32 [rows, hidden], prompt order
    kept_rows: np.ndarray   # int64 [rows]: which of the tower's rows these are (EVS)

    def to_tensors(self) -> dict[str, np.ndarray]:
        return write(encoder_outputs(-1), vars(self))


# ---- vision_encoder_batch ------------------------------------------------------------------------
@dataclass(frozen=True)
class EncoderBatchRequest:
    """One request of the front to the batched model: each patch row's item grid and extras."""
    pixel_values: np.ndarray               # float32 [N, D]
    patch_grid: np.ndarray                 # int64 [N, 3]
    odd_share: bool = False
    patch_extras: dict[str, np.ndarray] = field(default_factory=dict)  # by extra name: int64 [N, width]

    def to_tensors(self) -> dict[str, np.ndarray]:
        tensors = {"pixel_values": np.ascontiguousarray(self.pixel_values, dtype=np.float32),
                   PATCH_GRID.name: np.asarray(self.patch_grid, dtype=np.int64)}
        tensors.update({EXTRA[name].patch_input: np.ascontiguousarray(rows, dtype=np.int64)
                        for name, rows in self.patch_extras.items()})
        if self.odd_share:
            tensors[ODD_SHARE.name] = np.ones((len(self.pixel_values), 1), dtype=bool)
        return tensors

    @classmethod
    def from_inputs(cls, get: Get) -> EncoderBatchRequest:
        return cls(required(get, "pixel_values"), required(get, PATCH_GRID.name), get(ODD_SHARE.name) is not None,
                   {extra.name: rows for extra in EXTRAS if (rows := get(extra.patch_input)) is not None})


# ---- llm ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LLMRequest:
    """A generation request's own inputs (its sampling inputs are `SamplingParams`)."""
    input_ids: np.ndarray
    embeddings: np.ndarray | None
    mrope_position_ids: np.ndarray
    mrope_position_delta: int
    media_position_ids: np.ndarray | None = None
    kept_rows: np.ndarray | None = None
    stream: bool = False

    @classmethod
    def from_inputs(cls, get: Get) -> LLMRequest:
        stream = bool(scalar(get, "stream", bool) or False)
        return cls(required(get, "input_ids"), get("embeddings"), required(get, "mrope_position_ids"),
                   int(required(get, "mrope_position_delta").reshape(-1)[0]), get("media_position_ids"),
                   get("kept_rows"), stream)
