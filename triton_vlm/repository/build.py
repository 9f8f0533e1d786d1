"""`triton-vlm build`: a complete Triton model repository from a local checkpoint: every model's
config (`configs`), its `model.py` adapter, the checkpoint files each model reads (weights only
where they are used) and the vision tower compiled ahead of time (ONNX, or a TensorRT engine).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from triton_vlm.clients.chat import load_chat_template
from triton_vlm.contract.tensors import ENCODER_BATCH_MODEL
from triton_vlm.devices import parse_dtype as torch_dtype
from triton_vlm.families import detect_family
from triton_vlm.repository.configs import (check_pipeline, encoder_backend, gpu_list, llm_options, model_configs,
                                           write_config)
from triton_vlm.repository.options import (CHECKPOINT_DIR, CHECKPOINT_FILES, ENCODER_FILE, ENGINE_FILE, SOURCE_MODELS,
                                           BuildOptions)
from triton_vlm.repository.sizing import MachineFacts, fixed, gpu_sizes


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link large weight files where the filesystem allows (real checkpoints are GBs)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _copy_checkpoint(checkpoint: Path, dst: Path, weights: bool) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        if (checkpoint / name).exists():
            shutil.copy2(checkpoint / name, dst / name)
    if weights:
        for path in checkpoint.glob("*.safetensors*"):
            _link_or_copy(path, dst / path.name)


def check_tensor_parallel(checkpoint: Path, ranks: int) -> None:
    """ValueError naming --tensor-parallel unless the checkpoint's decoder splits over `ranks`."""
    from triton_vlm.llm.config import DecoderConfig
    from triton_vlm.llm.distributed.sharding import Shard

    if ranks < 1:
        raise ValueError(f"--tensor-parallel {ranks}: expected 1 or more")
    try:
        Shard(0, ranks).check(DecoderConfig.from_checkpoint(checkpoint))
    except ValueError as error:
        raise ValueError(f"--tensor-parallel {ranks}: {error}") from None


def sized_options(checkpoint: Path, options: BuildOptions, facts: MachineFacts | None = None
                  ) -> tuple[BuildOptions, list[str]]:
    """`options` with what the build sizes chosen (`triton_vlm.repository.sizing`; on a GPU build
    from `facts`, this machine's by default), and the lines saying what was chosen."""
    backend, dtype = encoder_backend(options)
    llm = llm_options(options)
    if options.device == "gpu" and llm.device.startswith("cuda"):
        gpus = gpu_list(options)
        encoder_bytes = (4 if options.trt_precision == "fp32" else 2) if backend == "tensorrt" else \
            torch_dtype(dtype).itemsize
        options, lines = gpu_sizes(options, checkpoint, facts or MachineFacts.here(gpus), gpus, encoder_bytes,
                                   backend != "onnxruntime", torch_dtype(llm.dtype).itemsize)
    else:
        lines = []
    options = fixed(options, llm.device)
    if not lines:
        kv = "as given" if options.kv_cache_tokens or options.kv_cache_bytes else "256 MiB"
        lines = [f"preprocess: {options.preprocess_instances} instances; vision_encoder: {options.encoder_frontends} "
                 f"fronts; llm: {options.llm_max_num_tokens} prompt rows a step, KV cache {kv}"]
    return options, lines


def build_repository(checkpoint: str | Path, repo: str | Path, options: BuildOptions = BuildOptions(),
                     facts: MachineFacts | None = None, report: Callable[[str], None] = lambda line: None) -> Path:
    """The repository; `report(line)` is told what the build chose where a flag was left to it."""
    checkpoint, repo = Path(checkpoint).resolve(), Path(repo)
    family = detect_family(checkpoint)
    checkpoint_config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    if options.device not in ("cpu", "gpu"):
        raise ValueError(f"--device {options.device}: expected cpu or gpu")
    family.pruning_rate(options.video_pruning_rate, "--video-pruning-rate")
    check_tensor_parallel(checkpoint, options.tensor_parallel)
    options, chosen = sized_options(checkpoint, options, facts)
    configs = model_configs(family, checkpoint_config, options, load_chat_template(checkpoint))
    check_pipeline(configs)
    for line in chosen:
        report(line)
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

    from triton_vlm.vision.runtime.export import export_onnx
    from triton_vlm.vision.runtime.tensorrt_engine import GRAPH_DTYPES, EngineProfile, build_engine

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
