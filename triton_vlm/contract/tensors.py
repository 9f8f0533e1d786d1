"""Every tensor of every step, as typed specs: the serving contract (shared/INTERFACE.md) in code.

The build writes each model's config from these lists (`triton_vlm.repository`), the Python-backend
adapters read and write their tensors through the messages made of them (`messages`), the
ensemble runs the steps that `STEPS` names, and its stream to the llm casts each tensor to its
spec (`triton_vlm.serving.loopback`). A tensor's name, type and shape are stated here once.

Per-item extras (`ItemExtra`, `EXTRAS`) are the one channel for what some towers need beside the
pixels (a packed frame's temporal id, an image's own size, the
patches a frame is padded to): `preprocess` gives each, the
`vision_encoder` front checks it and sends it per patch row to `vision_encoder_batch`, and the
tower takes it by name (`Tower.EXTRAS`). A new one is a line in `EXTRAS`.

Attention masks take no tensor: a decoder whose media blocks attend both ways in prefill (Gemma 3)
finds each block as a run of placeholder tokens in `input_ids` (`DecoderConfig.bidirectional_media`),
and sliding windows come from the checkpoint's config.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from triton_vlm.errors import InvalidInput

# Triton's data type names (tritonclient's `np_to_triton_dtype`) and their numpy types.
NUMPY = {"BYTES": np.object_, "FP32": np.float32, "FP64": np.float64, "INT32": np.int32, "INT64": np.int64,
         "UINT64": np.uint64, "BOOL": np.bool_}
INT32_MAX = int(np.iinfo(np.int32).max)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton's name, a key of NUMPY
    dims: tuple[int, ...]
    optional: bool = False

    @property
    def numpy(self) -> type:
        return NUMPY[self.dtype]

    def as_optional(self) -> TensorSpec:
        return dataclasses.replace(self, optional=True)

    def array(self, value) -> np.ndarray:
        """`value` as this tensor, contiguous, in its dtype (a scalar as [1]); no copy where it is one."""
        return np.ascontiguousarray(value, dtype=self.numpy)


# ---- ensemble (and the llm's sampling inputs) ------------------------------------------------------
MEDIA_INPUTS = (
    TensorSpec("text_input", "BYTES", (1,)),
    TensorSpec("images", "BYTES", (-1,), optional=True),
    TensorSpec("videos", "BYTES", (-1,), optional=True),
    # a JSON object: numbers, and the booleans a family's processor takes (`ProcessorRules.image_flags`)
    TensorSpec("mm_options", "BYTES", (1,), optional=True),
)
# Generation controls, read by `SamplingParams.from_inputs` (`triton_vlm.contract.sampling`): ours,
# then tensorrtllm_backend's other ensemble inputs with their names, types and shapes (`min_length`
# and `random_seed`: its older names of `min_tokens` and `seed`), each honoured or refused by value.
SAMPLING_INPUTS = (
    TensorSpec("max_tokens", "INT32", (1,)),
    *(TensorSpec(name, dtype, dims, optional=True) for name, dtype, dims in (
        ("temperature", "FP32", (1,)), ("top_p", "FP32", (1,)), ("top_k", "INT32", (1,)), ("seed", "UINT64", (1,)),
        ("stop_words", "BYTES", (-1,)), ("stream", "BOOL", (1,)), ("repetition_penalty", "FP32", (1,)),
        ("bad_words", "BYTES", (-1,)), ("exclude_input_in_output", "BOOL", (1,)), ("end_id", "INT32", (1,)),
        ("pad_id", "INT32", (1,)), ("length_penalty", "FP32", (1,)), ("min_tokens", "INT32", (1,)),
        ("min_length", "INT32", (1,)), ("presence_penalty", "FP32", (1,)), ("frequency_penalty", "FP32", (1,)),
        ("random_seed", "UINT64", (1,)), ("beam_width", "INT32", (1,)), ("num_return_sequences", "INT32", (1,)),
        ("num_top_log_probs", "INT32", (1,)),
        ("return_log_probs", "BOOL", (1,)), ("return_context_logits", "BOOL", (1,)),
        ("return_generation_logits", "BOOL", (1,)), ("return_perf_metrics", "BOOL", (1,)),
        ("return_num_input_tokens", "BOOL", (1,)), ("return_num_output_tokens", "BOOL", (1,)),
        ("guided_decoding_guide_type", "BYTES", (1,)), ("guided_decoding_guide", "BYTES", (1,)),
        ("embedding_bias", "FP32", (-1,)))),
)
# tensorrtllm_backend's `stop`: a request with this set ends the in-flight request of the same id.
STOP_INPUT = TensorSpec("stop", "BOOL", (1,), optional=True)
# tensorrtllm_backend's but for `top_log_probs` / `top_log_prob_ids` (ours: [1, tokens, k] each), sent as
# `ResponseBuilder` (triton_vlm.llm.engine.responses) says.
GENERATION_OUTPUTS = (
    TensorSpec("text_output", "BYTES", (1,)),
    TensorSpec("output_ids", "INT32", (-1,)),
    TensorSpec("finish_reason", "BYTES", (1,)),
    TensorSpec("cum_log_probs", "FP32", (-1,)),
    TensorSpec("output_log_probs", "FP32", (-1, -1)),
    TensorSpec("num_input_tokens", "INT32", (1,)),
    TensorSpec("num_output_tokens", "INT32", (1,)),
    TensorSpec("sequence_index", "INT32", (1,)),
    TensorSpec("top_log_probs", "FP32", (-1, -1, -1)),
    TensorSpec("top_log_prob_ids", "INT32", (-1, -1, -1)),
)
# The output whose presence (non-empty) marks a stream's last response.
FINAL_OUTPUT = "finish_reason"


# ---- per-item extras ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ItemExtra:
    """Integers some towers take beside the pixels: `width` of them per frame of each grid row
    (`per_frame`) or per grid row, `none` where there is nothing to say. On the contract it is the
    tensor `name`; to `vision_encoder_batch` it goes one row per patch as `patch_input`."""
    name: str
    per_frame: bool
    width: int
    none: int
    patch_input: str

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, "INT64", (-1,) if self.width == 1 else (-1, self.width))

    @property
    def patch_spec(self) -> TensorSpec:
        return TensorSpec(self.patch_input, "INT64", (self.width,), optional=True)

    def _unit(self) -> str:
        return "frame" if self.per_frame else "row"

    def counts(self, grid: np.ndarray) -> np.ndarray:
        """Patch rows of each value: a frame's h * w, or a grid row's t * h * w."""
        grid = np.asarray(grid, dtype=np.int64).reshape(-1, 3)
        return np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0]) if self.per_frame else grid.prod(axis=1)

    def empty(self, grid: np.ndarray) -> np.ndarray:
        """int64: `none` for every frame (or grid row) of `grid`."""
        return np.full((len(self.counts(grid)), self.width), self.none, np.int64).reshape(self._shape(grid))

    def _shape(self, grid: np.ndarray) -> tuple[int, ...]:
        n = len(self.counts(grid))
        return (n,) if self.width == 1 else (n, self.width)

    def check(self, value, grid: np.ndarray, taken: bool) -> np.ndarray | None:
        """The contract's input: int64 of `_shape`, values in [`none`, int32 max]. None when absent or
        all `none`; InvalidInput names the input, also when the tower takes none (`taken` False)."""
        if value is None:
            return None
        array, shape = np.asarray(value), self._shape(grid)
        if array.shape != shape:
            raise InvalidInput(f"{self.name}: expected shape {list(shape)} (one per {self._unit()} of grid_thw), "
                               f"got {list(array.shape)}")
        if not np.issubdtype(array.dtype, np.integer):
            raise InvalidInput(f"{self.name}: expected integers, got {array.dtype}")
        array = array.astype(np.int64)
        if (array < self.none).any() or (array > INT32_MAX).any():
            raise InvalidInput(f"{self.name}: values must lie in [{self.none}, {INT32_MAX}]")
        if (array == self.none).all():
            return None
        if not taken:
            raise InvalidInput(f"{self.name}: this model's vision tower takes none")
        return array

    def rows(self, value: np.ndarray | None, grid: np.ndarray) -> np.ndarray:
        """int64 [N, width]: each patch row's value (None: `none`)."""
        value = self.empty(grid) if value is None else np.asarray(value, np.int64)
        return np.repeat(value.reshape(-1, self.width), self.counts(grid), axis=0)

    def from_rows(self, rows, grid: np.ndarray) -> np.ndarray:
        """The values back from their patch rows (`rows`); InvalidInput if a frame's (a grid row's)
        rows disagree."""
        counts = self.counts(grid)
        rows = np.asarray(rows)
        if rows.size == int(counts.sum()) * self.width:
            rows = rows.reshape(-1, self.width)
        if rows.shape != (int(counts.sum()), self.width) or not np.issubdtype(rows.dtype, np.integer):
            raise InvalidInput(f"{self.patch_input}: expected int64 [{int(counts.sum())}, {self.width}], "
                               f"got {list(rows.shape)}")
        values = rows[np.concatenate([[0], np.cumsum(counts)])[:-1].astype(np.int64)].astype(np.int64)
        if (np.repeat(values, counts, axis=0) != rows).any():
            unit = "a frame" if self.per_frame else "an item"
            raise InvalidInput(f"{self.patch_input}: the rows of {unit} disagree")
        return values.reshape(self._shape(grid))

    def item(self, value: np.ndarray, row: int, frame: int, frames: int) -> np.ndarray:
        """The values of one grid row (the `row`-th, its frames from `frame`)."""
        return value[frame:frame + frames] if self.per_frame else value[row:row + 1]


EXTRAS = (
    # A packed video group's frames' temporal ids (`ProcessorRules.pack_frames`), for a resampler.
    ItemExtra("temporal_ids", per_frame=True, width=1, none=-1, patch_input="patch_temporal_id"),
    # An image's own (height, width) (`ProcessorRules.image_sizes`), for a tower that unpads by it.
    ItemExtra("image_sizes", per_frame=False, width=2, none=0, patch_input="patch_image_size"),
    # The patches every frame of a grid row is zero-padded to before the tower's attention (the
    # request's largest frame, `ProcessorRules.padded_patches`); none: its own h * w.
    ItemExtra("padded_patches", per_frame=False, width=1, none=0, patch_input="patch_padded_patches"),
)
EXTRA = {extra.name: extra for extra in EXTRAS}


# ---- preprocess, vision_encoder, vision_encoder_batch, llm ----------------------------------------
# EVS video pruning (triton_vlm.media.evs): preprocess gives the request's rate to the encoder and
# the unpruned positions of every media token to the llm; the encoder gives the llm the index of
# each row it kept; the llm completes the positions (triton_vlm.media.mrope.complete_positions). The
# rate travels as FP64: both ends compute the kept count from the very same value.
PRUNING_RATE = TensorSpec("video_pruning_rate", "FP64", (1,))
MEDIA_POSITIONS = TensorSpec("media_position_ids", "INT64", (3, -1))
KEPT_ROWS = TensorSpec("kept_rows", "INT64", (-1,))
INPUT_IDS = TensorSpec("input_ids", "INT32", (-1,))
GRID_THW = TensorSpec("grid_thw", "INT64", (-1, 3))
POSITIONS = (TensorSpec("mrope_position_ids", "INT64", (3, -1)), TensorSpec("mrope_position_delta", "INT64", (1,)))

PREPROCESS_OUTPUTS = (INPUT_IDS, TensorSpec("pixel_values", "FP32", (-1, -1)), GRID_THW, *POSITIONS, PRUNING_RATE,
                      MEDIA_POSITIONS, *(extra.spec for extra in EXTRAS))


def encoder_inputs(patch_dim: int) -> tuple[TensorSpec, ...]:
    return (TensorSpec("pixel_values", "FP32", (-1, patch_dim)), GRID_THW, PRUNING_RATE.as_optional(),
            *(extra.spec.as_optional() for extra in EXTRAS))


def embedding_width(hidden: int, deepstack_maps: int = 0) -> int:
    """The width of a row of `embeddings` (the encoder's output, the llm's input: one row per media
    placeholder token, in the model's dtype, FP32 on a CPU build): the token's input embedding
    (`hidden` wide) and, where the decoder takes DeepStack feature maps (Qwen3-VL:
    `vision_config.deepstack_visual_indexes`), each map after it, `hidden` wide each, in that
    order; the llm adds map i to the token's hidden state after decoder layer i, in prefill. Every
    stage that carries rows (batching, the encoder cache, EVS `kept_rows`) carries them whole."""
    return hidden * (1 + deepstack_maps)


def encoder_outputs(hidden: int) -> tuple[TensorSpec, ...]:
    return TensorSpec("embeddings", "FP32", (-1, hidden)), KEPT_ROWS


# `vision_encoder_batch` (max_batch_size > 0): dims are per row; the batch is the patch rows
# (`patch_grid`: the [t, h, w] of each row's item, see triton_vlm.vision.batching). `odd_share`
# is sent with odd shares of a request split over the instances (`triton_vlm.vision.front`); each
# extra's `patch_input` where the request has it.
ODD_SHARE = TensorSpec("odd_share", "BOOL", (1,), optional=True)
PATCH_GRID = TensorSpec("patch_grid", "INT64", (3,))


def encoder_batch_inputs(patch_dim: int) -> tuple[TensorSpec, ...]:
    return (TensorSpec("pixel_values", "FP32", (patch_dim,)), PATCH_GRID, ODD_SHARE,
            *(extra.patch_spec for extra in EXTRAS))


def encoder_batch_outputs(hidden: int) -> tuple[TensorSpec, ...]:
    return (TensorSpec("embeddings", "FP32", (hidden,)),)


def llm_inputs(hidden: int) -> tuple[TensorSpec, ...]:
    """Every input is optional in the config so that a `stop` request needs nothing else; the llm
    itself answers a generation request that lacks one with INVALID_ARG naming it."""
    own = (INPUT_IDS, TensorSpec("embeddings", "FP32", (-1, hidden)), *POSITIONS, MEDIA_POSITIONS, KEPT_ROWS)
    return tuple(spec.as_optional() for spec in own + SAMPLING_INPUTS) + (STOP_INPUT,)


# ---- the ensemble's steps -------------------------------------------------------------------------
ENCODER_BATCH_MODEL = "vision_encoder_batch"


@dataclass(frozen=True)
class Step:
    """One model the ensemble calls: the tensors it takes (those available are passed) and gives.
    `skip_when_empty`: an input that, given and empty, means the step has nothing to do (the
    vision encoder for a request without media); it is not called and gives nothing.
    `calls`: the models it calls itself (the encoder front's batch model): a death of one of them
    ends its requests as the step's own does (`Pipeline.abort`)."""
    model: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    skip_when_empty: str = ""
    calls: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"model": self.model, "inputs": list(self.inputs), "outputs": list(self.outputs),
                **({"skip_when_empty": self.skip_when_empty} if self.skip_when_empty else {}),
                **({"calls": list(self.calls)} if self.calls else {})}

    @classmethod
    def from_json(cls, step: dict) -> Step:
        return cls(step["model"], tuple(step["inputs"]), tuple(step["outputs"]), step.get("skip_when_empty", ""),
                   tuple(step.get("calls", ())))


# What the ensemble knows of its steps beside their tensors: a request without media does not call
# the encoder, whose front calls the batched encoder.
STEP_ROLES = {"vision_encoder": dict(skip_when_empty="pixel_values", calls=(ENCODER_BATCH_MODEL,))}
