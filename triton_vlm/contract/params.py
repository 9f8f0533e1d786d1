"""Typed model parameters: what `triton-vlm build` writes into a model's `config.pbtxt` and the
model reads back in `initialize`.

Each class is a frozen dataclass whose fields travel as Triton config parameters (string values):
`to_params()` writes them (`triton_vlm.repository.configs`), `from_params()` reads them back (the
adapters of `triton_vlm.serving.backend`), so a parameter's name, type and default are stated once.
`Limits` (`triton_vlm.contract.limits`) is one too. Beside them, what the server tells its models
in their environment (`URL_ENV`, `PYTHON_ENV`) and the ensemble asks of the llm in a request
parameter (`ERROR_CODES`).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

P = TypeVar("P", bound="ModelParams")

# Set by `triton_vlm.server.tritonserver.TritonServer` for the models of the server it starts: its
# own gRPC address (the ensemble's stream to the llm; tritonserver's default, `DEFAULT_URL`,
# otherwise) and the interpreter a model's own processes run (inside a stub `sys.executable` is the
# stub).
URL_ENV, DEFAULT_URL = "TRITON_VLM_GRPC_URL", "127.0.0.1:8001"
PYTHON_ENV = "TRITON_VLM_PYTHON"
# Request parameter asking the llm to prefix its error messages with their code.
ERROR_CODES = "vlm_error_codes"  # (tritonclient reserves names starting "triton_")


def _kind(hint: Any) -> type:
    """The value type of a field's hint; `X | None` is X."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _encode(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _decode(kind: type, name: str, text: str) -> Any:
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{name}: expected true or false, got {text!r}")
        return text.lower() == "true"
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}: expected {kind.__name__}, got {text!r}") from None


def instance_device(args: Mapping[str, str], device: str) -> str:
    """Where a Triton model instance runs (`args`: its `initialize` arguments): a KIND_GPU instance
    asked for `cuda` runs on its own GPU (`model_instance_device_id`: cuda:N); any other `device`
    (cpu, cuda:N) stays as it is."""
    if device == "cuda" and args.get("model_instance_kind") == "GPU":
        return f"cuda:{int(args['model_instance_device_id'])}"
    return device


class ModelParams:
    """Base of the parameter dataclasses; a field that is None is not written."""

    def to_params(self) -> dict[str, str]:
        """The fields as model config parameters (string values)."""
        return {f.name: _encode(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def from_params(cls: type[P], params: Mapping[str, str]) -> P:
        """From model config parameters; keys that are not fields are ignored, a missing field takes
        its default (ValueError naming a required one, or a value of the wrong type)."""
        hints = typing.get_type_hints(cls)
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in params:
                values[f.name] = _decode(_kind(hints[f.name]), f.name, params[f.name])
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{cls.__name__}: parameter {f.name} is missing")
        return cls(**values)


@dataclass(frozen=True)
class LLMOptions(ModelParams):
    """The `llm` model: the `Engine`'s keyword arguments (see its docstring)."""
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_tokens: int = 0      # 0: kv_cache_bytes decides
    kv_cache_bytes: int = 0       # 0: the Engine's default
    block_size: int = 16
    prefix_caching: bool = False
    max_running: int = 64
    max_num_tokens: int = 512
    queue_timeout_ms: int = 0     # 0: a request waits for its place as long as it takes
    cuda_graphs: bool = True      # CUDA: decode steps replay graphs captured at batch-size buckets
    mixed_steps: bool = True      # a step may hold prompt chunks and decodes together (off: apart)
    paged_prefill: bool = False   # CUDA: prompt chunks through the paged prefill kernel (off: SDPA per chunk)
    tensor_parallel: int = 1      # ranks the decoder is split over (triton_vlm.llm.engine.tensor_parallel)


@dataclass(frozen=True)
class PreprocessOptions(ModelParams):
    """The `preprocess` model beyond its `Limits`: the build's default EVS video pruning rate
    (`mm_options.video_pruning_rate` overrides it per request; triton_vlm.media.evs)."""
    video_pruning_rate: float = 0.0


@dataclass(frozen=True)
class EncoderOptions(ModelParams):
    """The `vision_encoder` front (`triton_vlm.vision.front`): the batched model it calls, the
    tower's dimensions, the patch rows of one batched execution, the batched model's instances (a
    request's items are split over them), and what it knows of the tower without importing it."""
    batch_model: str
    patch_dim: int
    hidden: int
    spatial_merge_size: int
    max_batch_patches: int
    batch_instances: int = 1
    packed_frames: bool = False  # grid rows are frame groups, taken whole (`Tower.PACKED_FRAMES`)
    extras: str = ""  # the per-item extras the tower takes, by name, comma-separated (`Tower.EXTRAS`)
    rows: str = "triton_vlm.vision.tower.rows:embedding_rows"  # its rows per item, "module:function" (`Tower.ROWS`)
    tower_settings: str = "{}"  # its settings (JSON), which `rows` counts with


@dataclass(frozen=True)
class EncoderBatchOptions(ModelParams):
    """`vision_encoder_batch`: its back end (triton_vlm.vision.runtime.backends): a TensorRT engine
    (`engine_file`), an ONNX graph run by ONNX Runtime (`encoder_file`, `intra_op_threads`; 0: the
    cores / `instances`) or the torch tower of the checkpoint folder `weights_dir` in `dtype`; and
    the embedding cache."""
    instances: int = 1
    cache_bytes: int = 0
    backend: str = "onnxruntime"
    engine_file: str | None = None
    encoder_file: str | None = None
    intra_op_threads: int | None = None
    weights_dir: str | None = None
    dtype: str | None = None
