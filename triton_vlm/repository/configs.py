"""Every model's `config.pbtxt`, made from the contract's tensors (`triton_vlm.contract.tensors`)
and the models' typed parameters (`triton_vlm.contract.params`) as `ModelConfig` protobuf messages
(tritonclient's copy of Triton's schema), written with `text_format` and parsed back
(`write_config`), and the ensemble's steps checked against the other configs (`check_pipeline`),
so a typo in a field name or type cannot reach the server.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from triton_vlm.contract.limits import Limits
from triton_vlm.contract.params import EncoderBatchOptions, EncoderOptions, LLMOptions, PreprocessOptions
from triton_vlm.contract.tensors import (ENCODER_BATCH_MODEL, FINAL_OUTPUT, GENERATION_OUTPUTS, MEDIA_INPUTS,
                                         PREPROCESS_OUTPUTS, SAMPLING_INPUTS, STEP_ROLES, STOP_INPUT, Step, TensorSpec,
                                         encoder_batch_inputs, encoder_batch_outputs, encoder_inputs, encoder_outputs,
                                         llm_inputs)
from triton_vlm.families.base import Family
from triton_vlm.repository.options import CHECKPOINT_DIR, ENCODER_FILE, ENGINE_FILE, BuildOptions
from triton_vlm.repository.sizing import fixed


def encoder_backend(options: BuildOptions) -> tuple[str, str]:
    """The encoder's back end and dtype for `options` (ValueError naming the flag)."""
    from triton_vlm.devices import DTYPES
    from triton_vlm.vision.runtime.backends import BACKENDS, default_backend

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
    backend, dtype = encoder_backend(options)
    runtime = {"tensorrt": dict(engine_file=ENGINE_FILE),
               "torch": dict(weights_dir=CHECKPOINT_DIR, dtype=dtype),
               "onnxruntime": dict(encoder_file=f"../../vision_encoder/1/{ENCODER_FILE}",
                                   intra_op_threads=options.encoder_threads)}[backend]
    batch = EncoderBatchOptions(instances=encoder_instances(options), cache_bytes=options.encoder_cache_bytes,
                                backend=backend, **runtime)
    config = _python_model(ENCODER_BATCH_MODEL, encoder_batch_inputs(patch_dim), encoder_batch_outputs(hidden),
                           options.encoder_instances, {**common, **batch.to_params()})
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


def _add_tensors(field, specs: tuple[TensorSpec, ...]) -> None:
    for spec in specs:
        data_type = getattr(mc, "TYPE_STRING" if spec.dtype == "BYTES" else f"TYPE_{spec.dtype}")
        tensor = field.add(name=spec.name, data_type=data_type, dims=list(spec.dims))
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
    """`ensemble`: a decoupled Python model that runs the steps in order (`triton_vlm.serving.pipeline`).

    Not a Triton ensemble: in Triton 2.51 an ensemble does not pass a client's cancellation on
    to a decoupled step that is already running (server issue 6739), so a cancelled or
    disconnected stream would keep the `llm` generating. This model sees the cancellation and
    sends the `llm` a `stop` request for the same request id (tensorrtllm_backend's `stop`).
    The step list is data in its parameters, checked by `check_pipeline`. The checkpoint's chat
    template is one too (`chat_template`), for clients that render prompts (`triton-vlm infer`).
    """
    description = [Step(m.name, tuple(t.name for t in m.input if t.name != STOP_INPUT.name),
                        tuple(t.name for t in m.output), **STEP_ROLES.get(m.name, {})).to_json() for m in steps]
    params = {"steps": json.dumps(description), "max_inflight_requests": str(options.max_inflight_requests),
              "final_output": FINAL_OUTPUT}
    if chat_template:
        params["chat_template"] = chat_template
    return _python_model("ensemble", MEDIA_INPUTS + SAMPLING_INPUTS, GENERATION_OUTPUTS, 1, params, decoupled=True)


def model_configs(family: Family, checkpoint_config: dict, options: BuildOptions,
                  chat_template: str | None = None) -> dict[str, mc.ModelConfig]:
    """Every model's config for one checkpoint and build, keyed by model name (a field left at 0
    that the build did not size takes its fixed default, `sizing.fixed`)."""
    options = fixed(options, llm_options(options).device)
    patch_dim, hidden = family.encoder_dims(checkpoint_config)
    common = {"family": family.name, "checkpoint": CHECKPOINT_DIR}
    preprocess_params = {**common, **limits(options).to_params(),
                         **PreprocessOptions(video_pruning_rate=options.video_pruning_rate).to_params()}
    preprocess = _bounded_queue(_python_model("preprocess", MEDIA_INPUTS, PREPROCESS_OUTPUTS,
                                              options.preprocess_instances, preprocess_params), options)
    tower = family.tower_class()
    tower_settings = tower.checkpoint_settings(checkpoint_config)
    front = EncoderOptions(batch_model=ENCODER_BATCH_MODEL, patch_dim=patch_dim, hidden=hidden,
                           spatial_merge_size=int(tower_settings["spatial_merge_size"]),
                           max_batch_patches=options.encoder_max_batch_patches,
                           batch_instances=encoder_instances(options), packed_frames=tower.PACKED_FRAMES,
                           extras=",".join(tower.EXTRAS), rows=f"{tower.ROWS.__module__}:{tower.ROWS.__qualname__}",
                           tower_settings=json.dumps(tower_settings))
    encoder = _bounded_queue(_python_model("vision_encoder", encoder_inputs(patch_dim), encoder_outputs(hidden),
                                           options.encoder_frontends, {**common, **front.to_params()}), options)
    encoder_batch = _encoder_batch_model(patch_dim, hidden, options, common)
    llm_params = {**common, **llm_options(options).to_params()}
    llm = _python_model("llm", llm_inputs(hidden), GENERATION_OUTPUTS, 1, llm_params, decoupled=True)
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
    from triton_vlm.devices import default_dtype, dtype_name, parse_device, parse_dtype

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

