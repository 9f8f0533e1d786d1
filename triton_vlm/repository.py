"""`triton-vlm build`: a complete Triton model repository from a local checkpoint.

Every `config.pbtxt` comes from `model_configs` below, as `ModelConfig` protobuf messages
(tritonclient's copy of Triton's schema), written with `text_format` and parsed back before
the build is called done, so a typo in a field name or type cannot reach the server.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from triton_vlm.chat import load_chat_template
from triton_vlm.families import detect_family
from triton_vlm.families.base import Family
from triton_vlm.limits import DEFAULT_LIMITS, Limits
from triton_vlm.options import EncoderBatchOptions, EncoderOptions, LLMOptions, PreprocessOptions

SOURCE_MODELS = Path(__file__).resolve().parent.parent / "model_repository"
CHECKPOINT_DIR = "checkpoint"  # inside each model's version folder
ENCODER_FILE = "encoder.onnx"  # in vision_encoder/1/; the batched model reads it from there
ENGINE_FILE = "encoder.plan"   # --device gpu: TensorRT engine, in vision_encoder_batch/1/
ENCODER_BATCH_MODEL = "vision_encoder_batch"
ODD_SHARE_INPUT = "odd_share"  # see encoder_batch_io
PATCH_TEMPORAL_INPUT = "patch_temporal_id"  # see encoder_batch_io
PATCH_IMAGE_SIZE_INPUT = "patch_image_size"  # see encoder_batch_io
# Small files every Python model may read; weights go only where they are used.
_CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                     "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")

BYTES, FP32, FP64, INT32, INT64, UINT64, BOOL = (mc.TYPE_STRING, mc.TYPE_FP32, mc.TYPE_FP64, mc.TYPE_INT32,
                                                 mc.TYPE_INT64, mc.TYPE_UINT64, mc.TYPE_BOOL)


@dataclass(frozen=True)
class BuildOptions:
    device: str = "cpu"
    preprocess_instances: int = 2
    limits: Limits = DEFAULT_LIMITS     # preprocess request limits (triton_vlm.limits)
    encoder_instances: int = 1          # instances of the batched encoder (`vision_encoder_batch`)
    encoder_threads: int = 0            # ONNX Runtime intra-op threads; 0: the cores / encoder_instances
    # The encoder's back end (triton_vlm.vision.backends; empty: its default for the device) and
    # dtype (empty: float32; torch on gpu: bfloat16; tensorrt: --trt-precision decides).
    encoder_backend: str = ""
    encoder_dtype: str = ""
    # --device gpu: the GPUs of the llm and encoder instances, e.g. "0,1" (empty: all visible at
    # build time; [0] where none is).
    gpus: str = ""
    encoder_frontends: int = 4          # instances of the light `vision_encoder` front (concurrent requests)
    # dynamic batcher: how long an idle instance waits for more requests (requests that queue while
    # it is busy are batched anyway); 5000 cost image requests 16% at concurrency 1 (RESULTS)
    encoder_max_queue_delay_us: int = 500
    encoder_max_batch_patches: int = 65536   # patch rows in one batched execution (one request may split)
    encoder_cache_bytes: int = 256 << 20     # embedding LRU per encoder instance; 0 disables it
    # --device gpu: TensorRT optimisation profile (patch rows per engine run) and precision.
    trt_min_patches: int = 4
    trt_opt_patches: int = 4096
    trt_max_patches: int = 16384
    trt_precision: str = "fp16"         # fp32 | fp16 | bf16
    # llm: the paged KV cache pool (tokens wins over bytes; 0 and 0: 256 MiB), its block size,
    # prompt-prefix block reuse, and the in-flight batch (requests, rows per step).
    kv_cache_tokens: int = 0
    kv_cache_bytes: int = 0
    kv_block_size: int = 16
    prefix_caching: bool = True
    llm_max_running: int = 64
    llm_max_num_tokens: int = 512
    # llm: where the decoder runs (cpu | cuda | cuda:N; empty: cpu, or cuda with --device gpu) and
    # in which dtype (float32 | bfloat16 | float16; empty: float32 on cpu, bfloat16 on cuda). The KV
    # cache is in that dtype. With --device gpu, `cuda` is each llm instance's own GPU.
    llm_device: str = ""
    llm_dtype: str = ""
    llm_cuda_graphs: str = "on"         # on | off: CUDA graphs of the llm's decode steps (CUDA only)
    llm_mixed_steps: bool = True        # prompt chunks and decodes in one step (off: apart; Scheduler)
    llm_paged_prefill: bool = False     # CUDA: prompt chunks through the paged prefill kernel (PagedPrefillAttention)
    tensor_parallel: int = 1            # ranks each llm instance splits its decoder over (llm/tensor_parallel.py)
    max_inflight_requests: int = 64     # `ensemble`: requests beyond this are refused at once (UNAVAILABLE)
    # Triton's queues of preprocess, vision_encoder and vision_encoder_batch: a request finding
    # max_queue_size waiting is refused at once, one that waited queue_timeout_ms is refused
    # (UNAVAILABLE) when the model next takes work. 0: unbounded.
    queue_timeout_ms: int = 60_000
    max_queue_size: int = 128
    # llm: a request still waiting for its first place in the in-flight batch after this long
    # ends with UNAVAILABLE (0: it waits as long as it takes).
    llm_queue_timeout_ms: int = 60_000
    # preprocess: the default EVS video pruning rate in [0, 1) (triton_vlm.evs; Qwen2.5-VL only),
    # which a request's mm_options.video_pruning_rate overrides.
    video_pruning_rate: float = 0.0


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: int
    dims: tuple[int, ...]
    optional: bool = False


# The contract of shared/INTERFACE.md, one list per model.
MEDIA_INPUTS = (
    TensorSpec("text_input", BYTES, (1,)),
    TensorSpec("images", BYTES, (-1,), optional=True),
    TensorSpec("videos", BYTES, (-1,), optional=True),
    TensorSpec("mm_options", BYTES, (1,), optional=True),
)
# Generation controls, read by `SamplingParams.from_inputs` (triton_vlm.sampling_params): ours, then
# tensorrtllm_backend's other ensemble inputs with their names, types and shapes (`min_length` and
# `random_seed`: its older names of `min_tokens` and `seed`), each honoured or refused by value.
SAMPLING_INPUTS = (
    TensorSpec("max_tokens", INT32, (1,)),
    TensorSpec("temperature", FP32, (1,), optional=True),
    TensorSpec("top_p", FP32, (1,), optional=True),
    TensorSpec("top_k", INT32, (1,), optional=True),
    TensorSpec("seed", UINT64, (1,), optional=True),
    TensorSpec("stop_words", BYTES, (-1,), optional=True),
    TensorSpec("stream", BOOL, (1,), optional=True),
    TensorSpec("repetition_penalty", FP32, (1,), optional=True),
    TensorSpec("bad_words", BYTES, (-1,), optional=True),
    TensorSpec("exclude_input_in_output", BOOL, (1,), optional=True),
    TensorSpec("end_id", INT32, (1,), optional=True),
    TensorSpec("pad_id", INT32, (1,), optional=True),
    TensorSpec("length_penalty", FP32, (1,), optional=True),
    TensorSpec("min_tokens", INT32, (1,), optional=True),
    TensorSpec("min_length", INT32, (1,), optional=True),
    TensorSpec("presence_penalty", FP32, (1,), optional=True),
    TensorSpec("frequency_penalty", FP32, (1,), optional=True),
    TensorSpec("random_seed", UINT64, (1,), optional=True),
    TensorSpec("beam_width", INT32, (1,), optional=True),
    TensorSpec("num_return_sequences", INT32, (1,), optional=True),
    TensorSpec("return_log_probs", BOOL, (1,), optional=True),
    TensorSpec("return_context_logits", BOOL, (1,), optional=True),
    TensorSpec("return_generation_logits", BOOL, (1,), optional=True),
    TensorSpec("return_perf_metrics", BOOL, (1,), optional=True),
    TensorSpec("return_num_input_tokens", BOOL, (1,), optional=True),
    TensorSpec("return_num_output_tokens", BOOL, (1,), optional=True),
)
# tensorrtllm_backend's `stop`: a request with this set ends the in-flight request of the same id.
STOP_INPUT = TensorSpec("stop", BOOL, (1,), optional=True)
# The last four are tensorrtllm_backend's, sent as `ResponseBuilder` (triton_vlm.llm.responses) says.
GENERATION_OUTPUTS = (
    TensorSpec("text_output", BYTES, (1,)),
    TensorSpec("output_ids", INT32, (-1,)),
    TensorSpec("finish_reason", BYTES, (1,)),
    TensorSpec("cum_log_probs", FP32, (-1,)),
    TensorSpec("output_log_probs", FP32, (-1, -1)),
    TensorSpec("num_input_tokens", INT32, (1,)),
    TensorSpec("num_output_tokens", INT32, (1,)),
)


def preprocess_outputs() -> tuple[TensorSpec, ...]:
    return (
        TensorSpec("input_ids", INT32, (-1,)),
        TensorSpec("pixel_values", FP32, (-1, -1)),
        TensorSpec("grid_thw", INT64, (-1, 3)),
        TensorSpec("mrope_position_ids", INT64, (3, -1)),
        TensorSpec("mrope_position_delta", INT64, (1,)),
        PRUNING_RATE,
        MEDIA_POSITIONS,
        TEMPORAL_IDS,
        IMAGE_SIZES,
    )


# EVS video pruning (triton_vlm.evs): preprocess gives the request's rate to the encoder and the
# unpruned positions of every media token to the llm; the encoder gives the llm the index of each
# row it kept; the llm completes the positions (triton_vlm.mrope.complete_positions). The rate
# travels as FP64: both ends compute the kept count from the very same value.
PRUNING_RATE = TensorSpec("video_pruning_rate", FP64, (1,))
MEDIA_POSITIONS = TensorSpec("media_position_ids", INT64, (3, -1))
KEPT_ROWS = TensorSpec("kept_rows", INT64, (-1,))
# Each frame's temporal id (one per frame of each grid_thw row, -1: none): MiniCPM-V 4.5's packed
# video frames (`Family.pack_frames`, `Tower.PACKED_FRAMES`), from preprocess to the encoder.
TEMPORAL_IDS = TensorSpec("temporal_ids", INT64, (-1,))
# Each grid row's image's own (height, width), (0, 0) for none (a video's): LLaVA-OneVision unpads
# the tiles' features by it (`Family.image_sizes`, `Tower.IMAGE_SIZES`), from preprocess to the encoder.
IMAGE_SIZES = TensorSpec("image_sizes", INT64, (-1, 2))


def encoder_io(patch_dim: int, hidden: int) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    return ((TensorSpec("pixel_values", FP32, (-1, patch_dim)), TensorSpec("grid_thw", INT64, (-1, 3)),
             dataclasses.replace(PRUNING_RATE, optional=True), dataclasses.replace(TEMPORAL_IDS, optional=True),
             dataclasses.replace(IMAGE_SIZES, optional=True)),
            (TensorSpec("embeddings", FP32, (-1, hidden)), KEPT_ROWS))


def encoder_batch_io(patch_dim: int, hidden: int) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """`vision_encoder_batch` (max_batch_size > 0): dims are per row; the batch is the patch rows
    (`patch_grid`: the [t, h, w] of each row's item, see triton_vlm.vision.batching). `odd_share`
    is sent with odd shares of a request split over the instances (`VisionEncoderModel`);
    `patch_temporal_id` where the tower packs frames (each row's frame's temporal id);
    `patch_image_size` where it takes image sizes (each row's item's)."""
    return ((TensorSpec("pixel_values", FP32, (patch_dim,)), TensorSpec("patch_grid", INT64, (3,)),
             TensorSpec(ODD_SHARE_INPUT, BOOL, (1,), optional=True),
             TensorSpec(PATCH_TEMPORAL_INPUT, INT64, (1,), optional=True),
             TensorSpec(PATCH_IMAGE_SIZE_INPUT, INT64, (2,), optional=True)),
            (TensorSpec("embeddings", FP32, (hidden,)),))


def encoder_backend(options: BuildOptions) -> tuple[str, str]:
    """The encoder's back end and dtype for `options` (ValueError naming the flag)."""
    from triton_vlm.llm.device import DTYPES
    from triton_vlm.vision.backends import BACKENDS, default_backend

    backend = options.encoder_backend or default_backend(options.device)
    dtypes = {"onnxruntime": ("float32", "float16"), "torch": tuple(DTYPES), "tensorrt": ("",)}.get(backend)
    if dtypes is None:
        raise ValueError(f"--encoder-backend {backend}: expected one of {', '.join(BACKENDS)}")
    if backend == "tensorrt" and options.device != "gpu":
        raise ValueError("--encoder-backend tensorrt needs --device gpu")
    gpu_torch = backend == "torch" and options.device == "gpu"
    dtype = options.encoder_dtype or ("bfloat16" if gpu_torch else dtypes[0])
    if dtype not in dtypes:
        if backend == "tensorrt":
            raise ValueError("--encoder-dtype is not for TensorRT engines: their graph's dtype follows "
                             f"--trt-precision (fp32 | fp16 | bf16), got --encoder-dtype {dtype}")
        raise ValueError(f"--encoder-dtype {dtype}: the {backend} back end runs {', '.join(dtypes)}")
    return backend, dtype


def gpu_list(options: BuildOptions) -> list[int]:
    """--device gpu: the GPUs of `--gpus`, else every one visible here, else [0]."""
    if options.gpus:
        try:
            return [int(g) for g in options.gpus.split(",")]
        except ValueError:
            raise ValueError(f"--gpus {options.gpus}: expected GPU numbers separated by commas, e.g. 0,1") from None
    import torch

    return list(range(torch.cuda.device_count())) or [0]


def _on_gpus(config: mc.ModelConfig, options: BuildOptions, per_instance: int = 1) -> mc.ModelConfig:
    """The model's instances (count per GPU) on the build's GPUs; with `per_instance` GPUs an
    instance (the llm's tensor-parallel ranks: rank r on the GPU r after the instance's), on the
    first of each run of that many consecutive GPUs."""
    gpus = gpu_list(options)
    runs = [gpus[i:i + per_instance] for i in range(0, len(gpus), per_instance)]
    if any(run != list(range(run[0], run[0] + per_instance)) for run in runs):
        raise ValueError(f"--tensor-parallel {per_instance}: the GPUs ({','.join(map(str, gpus))}) must come in "
                         f"runs of {per_instance} consecutive ones, one run per llm instance")
    group = config.instance_group[0]
    group.kind = mc.ModelInstanceGroup.KIND_GPU
    group.gpus.extend(run[0] for run in runs)
    return config


def encoder_instances(options: BuildOptions) -> int:
    """Instances of `vision_encoder_batch` in all: per GPU on GPUs, else as asked."""
    on_gpu = options.device == "gpu" and encoder_backend(options)[0] != "onnxruntime"
    return options.encoder_instances * (len(gpu_list(options)) if on_gpu else 1)


def _encoder_batch_model(patch_dim: int, hidden: int, options: BuildOptions, common: dict[str, str]) -> mc.ModelConfig:
    enc_in, enc_out = encoder_batch_io(patch_dim, hidden)
    backend, dtype = encoder_backend(options)
    runtime = {"tensorrt": dict(engine_file=ENGINE_FILE),
               "torch": dict(weights_dir=CHECKPOINT_DIR, dtype=dtype),
               "onnxruntime": dict(encoder_file=f"../../vision_encoder/1/{ENCODER_FILE}",
                                   intra_op_threads=options.encoder_threads)}[backend]
    batch = EncoderBatchOptions(instances=encoder_instances(options), cache_bytes=options.encoder_cache_bytes,
                                backend=backend, **runtime)
    config = _python_model(ENCODER_BATCH_MODEL, enc_in, enc_out, options.encoder_instances,
                           {**common, **batch.to_params()})
    config.max_batch_size = options.encoder_max_batch_patches
    config.dynamic_batching.max_queue_delay_microseconds = options.encoder_max_queue_delay_us
    if options.device == "gpu" and backend != "onnxruntime":
        _on_gpus(config, options)
    return _bounded_queue(config, options)


def _bounded_queue(config: mc.ModelConfig, options: BuildOptions) -> mc.ModelConfig:
    """Triton's queue of a model, bounded: REJECT (UNAVAILABLE) what waited too long or finds it full.
    With max_batch_size 0 the dynamic batcher still runs one request per execution, as without it."""
    policy = config.dynamic_batching.default_queue_policy
    policy.timeout_action = mc.ModelQueuePolicy.REJECT
    policy.default_timeout_microseconds = options.queue_timeout_ms * 1000
    policy.max_queue_size = options.max_queue_size
    return config


def _add_tensors(field, specs) -> None:
    for spec in specs:
        tensor = field.add(name=spec.name, data_type=spec.data_type, dims=list(spec.dims))
        if spec.optional:
            tensor.optional = True


def _python_model(name: str, inputs, outputs, instances: int, parameters: dict[str, str],
                  decoupled: bool = False) -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    _add_tensors(config.input, inputs)
    _add_tensors(config.output, outputs)
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=instances)
    if decoupled:
        config.model_transaction_policy.decoupled = True
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


def _pipeline(steps: list[mc.ModelConfig], options: BuildOptions, chat_template: str | None = None) -> mc.ModelConfig:
    """`ensemble`: a decoupled Python model that runs the steps in order (`triton_vlm.loopback`).

    Not a Triton ensemble: in Triton 2.51 an ensemble does not pass a client's cancellation on
    to a decoupled step that is already running (server issue 6739), so a cancelled or
    disconnected stream would keep the `llm` generating. This model sees the cancellation and
    sends the `llm` a `stop` request for the same request id (tensorrtllm_backend's `stop`).
    The step list is data in its parameters, checked by `check_pipeline`. The checkpoint's chat
    template is one too (`chat_template`), for clients that render prompts (`triton-vlm infer`).
    """
    description = [{"model": m.name, "inputs": [t.name for t in m.input if t.name != STOP_INPUT.name],
                    "outputs": [t.name for t in m.output]} for m in steps]
    for step in description:  # a request without media does not call the encoder
        if step["model"] == "vision_encoder":
            step["skip_when_empty"] = "pixel_values"
            step["calls"] = [ENCODER_BATCH_MODEL]
    params = {"steps": json.dumps(description), "max_inflight_requests": str(options.max_inflight_requests),
              "final_output": "finish_reason"}
    if chat_template:
        params["chat_template"] = chat_template
    return _python_model("ensemble", MEDIA_INPUTS + SAMPLING_INPUTS, GENERATION_OUTPUTS, 1, params, decoupled=True)


def model_configs(family: Family, checkpoint_config: dict, options: BuildOptions,
                  chat_template: str | None = None) -> dict[str, mc.ModelConfig]:
    """Every model's config for one checkpoint and build, keyed by model name."""
    patch_dim, hidden = family.encoder_dims(checkpoint_config)
    common = {"family": family.name, "checkpoint": CHECKPOINT_DIR}
    preprocess_params = {**common, **limits(options).to_params(),
                         **PreprocessOptions(video_pruning_rate=options.video_pruning_rate).to_params()}
    preprocess = _bounded_queue(_python_model("preprocess", MEDIA_INPUTS, preprocess_outputs(),
                                              options.preprocess_instances, preprocess_params), options)
    enc_in, enc_out = encoder_io(patch_dim, hidden)
    tower = family.tower_class()
    tower_settings = tower.checkpoint_settings(checkpoint_config)
    front = EncoderOptions(batch_model=ENCODER_BATCH_MODEL, patch_dim=patch_dim, hidden=hidden,
                           spatial_merge_size=int(tower_settings["spatial_merge_size"]),
                           max_batch_patches=options.encoder_max_batch_patches,
                           batch_instances=encoder_instances(options), query_num=int(tower_settings.get("query_num", 0)),
                           packed_frames=tower.PACKED_FRAMES, extra_rows=int(tower_settings.get("extra_rows", 0)),
                           anyres_settings=json.dumps(tower_settings) if tower.IMAGE_SIZES else "")
    encoder = _bounded_queue(_python_model("vision_encoder", enc_in, enc_out, options.encoder_frontends,
                                           {**common, **front.to_params()}), options)
    encoder_batch = _encoder_batch_model(patch_dim, hidden, options, common)
    llm_in = (TensorSpec("input_ids", INT32, (-1,)), TensorSpec("embeddings", FP32, (-1, hidden)),
              TensorSpec("mrope_position_ids", INT64, (3, -1)), TensorSpec("mrope_position_delta", INT64, (1,)),
              MEDIA_POSITIONS, KEPT_ROWS)
    llm_params = {**common, **llm_options(options).to_params()}
    # Optional in the config so that a `stop` request needs nothing else; the llm itself answers a
    # generation request that lacks one of them with INVALID_ARG naming it.
    llm_inputs = tuple(dataclasses.replace(t, optional=True) for t in llm_in + SAMPLING_INPUTS)
    llm = _python_model("llm", llm_inputs + (STOP_INPUT,), GENERATION_OUTPUTS, 1, llm_params, decoupled=True)
    if options.device == "gpu" and llm_params["device"].startswith("cuda"):
        _on_gpus(llm, options, per_instance=options.tensor_parallel)
    ensemble = _pipeline([preprocess, encoder, llm], options, chat_template)
    return {c.name: c for c in (preprocess, encoder, encoder_batch, llm, ensemble)}


def limits(options: BuildOptions) -> Limits:
    """`preprocess`'s limits: a frame is at most what one encoder run takes (`max_frame_patches`
    lowered to the batched encoder's rows and, for TensorRT, its profile's maximum), so a larger
    one is INVALID_ARG from `preprocess` and never reaches the encoder."""
    runs = [options.limits.max_frame_patches, options.encoder_max_batch_patches]
    if encoder_backend(options)[0] == "tensorrt":
        runs.append(options.trt_max_patches)
    return dataclasses.replace(options.limits, max_frame_patches=min(runs))


def llm_options(options: BuildOptions) -> LLMOptions:
    """The `llm` model's parameters. Device and dtype are checked by the llm's own parser (ValueError
    naming what is accepted); an empty `llm_device` is cpu (cuda with --device gpu), an empty
    `llm_dtype` float32 on cpu, bfloat16 on cuda."""
    from triton_vlm.llm.device import default_dtype, dtype_name, parse_device, parse_dtype

    device = parse_device(options.llm_device or ("cuda" if options.device == "gpu" else "cpu"))
    if options.llm_cuda_graphs not in ("on", "off"):
        raise ValueError(f"--llm-cuda-graphs {options.llm_cuda_graphs}: expected on or off")
    dtype = parse_dtype(options.llm_dtype) if options.llm_dtype else default_dtype(device)
    return LLMOptions(device=str(device), dtype=dtype_name(dtype), kv_cache_tokens=options.kv_cache_tokens,
                      kv_cache_bytes=options.kv_cache_bytes, block_size=options.kv_block_size,
                      prefix_caching=options.prefix_caching, max_running=options.llm_max_running,
                      max_num_tokens=options.llm_max_num_tokens, queue_timeout_ms=options.llm_queue_timeout_ms,
                      cuda_graphs=options.llm_cuda_graphs == "on", mixed_steps=options.llm_mixed_steps,
                      paged_prefill=options.llm_paged_prefill, tensor_parallel=options.tensor_parallel)


def write_config(config: mc.ModelConfig, path: Path) -> None:
    """Write a config and check that it parses back to the same message."""
    text = text_format.MessageToString(config)
    path.write_text(text, encoding="utf-8")
    parsed = text_format.Parse(path.read_text(encoding="utf-8"), mc.ModelConfig())
    if parsed != config:
        raise RuntimeError(f"{path}: config did not survive a text round trip")


def check_pipeline(configs: dict[str, mc.ModelConfig]) -> None:
    """Every tensor a step needs is an `ensemble` input or an earlier step's output, of the same
    type; what a step that may be skipped gives is optional wherever it is taken."""
    ensemble = configs["ensemble"]
    available = {t.name: t.data_type for t in ensemble.input}
    steps = json.loads(ensemble.parameters["steps"].string_value)
    for i, step in enumerate(steps):
        if step.get("skip_when_empty"):
            if step["skip_when_empty"] not in step["inputs"]:
                raise RuntimeError(f"ensemble: {step['model']} is skipped on an input it does not take")
            for later in steps[i + 1:]:
                for tensor in configs[later["model"]].input:
                    if tensor.name in step["outputs"] and tensor.name in later["inputs"] and not tensor.optional:
                        raise RuntimeError(f"ensemble: {later['model']}.{tensor.name} is required but "
                                           f"{step['model']} may be skipped")
    for step in steps:
        model = configs[step["model"]]
        if unknown := [m for m in step.get("calls", ()) if m not in configs]:
            raise RuntimeError(f"ensemble: {model.name} calls {unknown}, not in the repository")
        for tensor in model.input:
            if tensor.name not in step["inputs"]:
                if not tensor.optional:
                    raise RuntimeError(f"ensemble: {model.name}.{tensor.name} is required but not passed")
            elif tensor.name not in available:
                if not tensor.optional:
                    raise RuntimeError(f"ensemble: {model.name}.{tensor.name} is produced by no earlier step")
            elif available[tensor.name] != tensor.data_type:
                raise RuntimeError(f"ensemble: {model.name}.{tensor.name} has another type upstream")
        available.update({t.name: t.data_type for t in model.output if t.name in step["outputs"]})
    for tensor in ensemble.output:
        if available.get(tensor.name) != tensor.data_type:
            raise RuntimeError(f"ensemble: output {tensor.name} is produced by no step")


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link large weight files where the filesystem allows (real checkpoints are GBs)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _copy_checkpoint(checkpoint: Path, dst: Path, weights: bool) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in _CHECKPOINT_FILES:
        if (checkpoint / name).exists():
            shutil.copy2(checkpoint / name, dst / name)
    if weights:
        for path in checkpoint.glob("*.safetensors*"):
            _link_or_copy(path, dst / path.name)


def check_tensor_parallel(checkpoint: Path, ranks: int) -> None:
    """ValueError naming --tensor-parallel unless the checkpoint's decoder splits over `ranks`."""
    from triton_vlm.llm.config import DecoderConfig
    from triton_vlm.llm.sharding import Shard

    if ranks < 1:
        raise ValueError(f"--tensor-parallel {ranks}: expected 1 or more")
    try:
        Shard(0, ranks).check(DecoderConfig.from_checkpoint(checkpoint))
    except ValueError as error:
        raise ValueError(f"--tensor-parallel {ranks}: {error}") from None


def build_repository(checkpoint: str | Path, repo: str | Path, options: BuildOptions = BuildOptions()) -> Path:
    checkpoint, repo = Path(checkpoint).resolve(), Path(repo)
    family = detect_family(checkpoint)
    checkpoint_config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    if options.device not in ("cpu", "gpu"):
        raise ValueError(f"--device {options.device}: expected cpu or gpu")
    family.pruning_rate(options.video_pruning_rate, "--video-pruning-rate")
    check_tensor_parallel(checkpoint, options.tensor_parallel)
    configs = model_configs(family, checkpoint_config, options, load_chat_template(checkpoint))
    check_pipeline(configs)
    backend, dtype = encoder_backend(options)

    if repo.exists():
        shutil.rmtree(repo)
    for name, config in configs.items():
        version = repo / name / "1"
        version.mkdir(parents=True)
        source = SOURCE_MODELS / name / "1" / "model.py"
        if source.exists():
            shutil.copy2(source, version / "model.py")
        if config.backend == "python":
            weights = name == "llm" or (name == ENCODER_BATCH_MODEL and backend == "torch")
            _copy_checkpoint(checkpoint, version / CHECKPOINT_DIR, weights=weights)
        write_config(config, repo / name / "config.pbtxt")

    from triton_vlm.vision.export import export_onnx
    from triton_vlm.vision.tensorrt_engine import GRAPH_DTYPES, EngineProfile, build_engine

    if backend == "torch":  # the tower runs from the checkpoint's weights
        return repo
    graph_dtype = GRAPH_DTYPES[options.trt_precision] if backend == "tensorrt" else dtype
    onnx_path = export_onnx(checkpoint, repo / "vision_encoder" / "1" / ENCODER_FILE, dtype=graph_dtype)
    if backend == "tensorrt":
        # Untested until a GPU runs it (see README): needs the `tensorrt` package and a GPU here.
        build_engine(onnx_path, repo / ENCODER_BATCH_MODEL / "1" / ENGINE_FILE,
                     EngineProfile(options.trt_min_patches, options.trt_opt_patches, options.trt_max_patches),
                     precision=options.trt_precision)
    return repo
