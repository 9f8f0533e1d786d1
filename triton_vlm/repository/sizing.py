"""What a build leaves to the machine (a `BuildOptions` field at 0), chosen from the machine: on a
GPU build the llm's KV cache from each GPU's memory, its prompt rows per step, and the instance
counts from the cores; elsewhere the fixed defaults. An explicit flag always wins.

The KV cache is what is left of the memory the build plans for on each GPU (vLLM's
`gpu_memory_utilization` of its total, and no more than is free while building) once everything
else that GPU holds is counted: the decoder's weights (its share of them with tensor parallelism),
a prompt step's activations (`llm_max_num_tokens` rows) and sampled logits, the decoder's CUDA
graphs, each vision encoder instance there (its weights and the activations of a batch of
`encoder_max_batch_patches` rows) and a CUDA context per process; and no more than every running
sequence at its full context can use. The activation terms are
estimates from the checkpoint's sizes (rows times a few times the widths), not measurements: the
GPU session checks them (the llm logs its pool at start).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from triton_vlm.repository.options import BuildOptions

GIB, MIB = 1 << 30, 1 << 20
# The fixed defaults (a CPU build, or a field the machine does not decide).
PREPROCESS_INSTANCES, ENCODER_FRONTENDS = 2, 4
PROMPT_ROWS = {"cpu": 512, "cuda": 8192}  # llm rows per step: vLLM's and SGLang's 8192 on a GPU
CONTEXT_BYTES = GIB  # a process's CUDA context and its allocator's slack, on each GPU it uses
GRAPH_BYTES = 512 * MIB  # the llm's decode CUDA graphs (their memory pool)
MIN_KV_BYTES = 64 * MIB


@dataclass(frozen=True)
class MachineFacts:
    """What the build machine offers: its cores, and each visible GPU's (total, free) bytes."""
    cores: int
    gpus: dict[int, tuple[int, int]]

    @classmethod
    def here(cls, gpus: list[int]) -> MachineFacts:
        """This machine's cores and the memory of `gpus` (none where CUDA is not available)."""
        import torch

        memory = {}
        if torch.cuda.is_available():
            for g in gpus:
                if g < torch.cuda.device_count():
                    free, total = torch.cuda.mem_get_info(g)
                    memory[g] = (int(total), int(free))
        return cls(os.cpu_count() or 1, memory)


def fixed(options: BuildOptions, llm_device: str) -> BuildOptions:
    """`options` with every field still at 0 at its fixed default (`llm_device`: the llm's, cpu or
    cuda[:N])."""
    return dataclasses.replace(
        options, preprocess_instances=options.preprocess_instances or PREPROCESS_INSTANCES,
        encoder_frontends=options.encoder_frontends or ENCODER_FRONTENDS,
        llm_max_num_tokens=options.llm_max_num_tokens or PROMPT_ROWS[llm_device.split(":")[0]])


def _weights(checkpoint: Path, decoder: Callable[[str], bool]) -> tuple[int, int]:
    """Elements of the decoder's tensors and of the rest (the vision tower's), from the safetensors
    headers alone."""
    from safetensors import safe_open

    counts = [0, 0]
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                counts[0 if decoder(key) else 1] += n
    return counts[0], counts[1]


def gpu_sizes(options: BuildOptions, checkpoint: Path, facts: MachineFacts, gpus: list[int],
              encoder_dtype_bytes: int, encoder_on_gpu: bool, llm_dtype_bytes: int) -> tuple[BuildOptions, list[str]]:
    """A GPU build's sizes from `facts` (module docstring), and the lines that say what was chosen."""
    import torch

    from triton_vlm.llm.config import DecoderConfig
    from triton_vlm.llm.model import decoder_weight

    lines = []
    preprocess = options.preprocess_instances or min(16, max(PREPROCESS_INSTANCES, facts.cores // 2))
    fronts = options.encoder_frontends or min(32, max(ENCODER_FRONTENDS, facts.cores))
    rows = options.llm_max_num_tokens or PROMPT_ROWS["cuda"]
    how = lambda given, flag: "as given" if given else f"{flag} to choose"  # noqa: E731
    lines.append(f"preprocess: {preprocess} instances ({facts.cores} cores; "
                 f"{how(options.preprocess_instances, '--preprocess-instances')})")
    lines.append(f"vision_encoder: {fronts} fronts ({how(options.encoder_frontends, '--encoder-frontends')})")
    lines.append(f"llm: {rows} prompt rows a step ({how(options.llm_max_num_tokens, '--llm-max-num-tokens')})")
    sized = dataclasses.replace(options, preprocess_instances=preprocess, encoder_frontends=fronts,
                                llm_max_num_tokens=rows)
    if options.kv_cache_tokens or options.kv_cache_bytes:
        lines.append("llm KV cache: as given (--kv-cache-mb / --kv-cache-tokens)")
        return sized, lines
    seen = [facts.gpus[g] for g in gpus if g in facts.gpus]
    if len(seen) < len(gpus):
        lines.append(f"llm KV cache: 256 MiB, the fixed default: GPU(s) {','.join(map(str, gpus))} not visible while "
                     "building (build on the serving machine, or give --kv-cache-mb)")
        return sized, lines
    config = DecoderConfig.from_checkpoint(checkpoint)
    decoder, vision = _weights(checkpoint, lambda key: decoder_weight(key, config))
    cfg = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    vision_cfg = cfg.get("vision_config") or {}
    v_hidden = int(vision_cfg.get("hidden_size", 1280))
    v_inter = int(vision_cfg.get("intermediate_size", 4 * v_hidden))
    ranks = options.tensor_parallel
    instances = options.encoder_instances if encoder_on_gpu else 0
    total, free = min(seen, key=lambda m: min(m[0] * options.gpu_memory_utilization, m[1]))
    budget = int(min(total * options.gpu_memory_utilization, free))
    terms = {
        "decoder weights": decoder * llm_dtype_bytes // ranks,
        f"prompt step ({rows} rows)": rows * ((8 + config.deepstack_maps) * config.hidden_size
                                              + 3 * config.intermediate_size // ranks)
        * llm_dtype_bytes + 2 * options.llm_max_running * config.vocab_size * 4,
        "CUDA graphs": GRAPH_BYTES if options.llm_cuda_graphs == "on" else 0,
        f"vision encoder ({instances} instance(s))": instances * (
            vision * encoder_dtype_bytes
            + options.encoder_max_batch_patches * (16 * v_hidden + 6 * v_inter) * encoder_dtype_bytes),
        f"CUDA contexts ({1 + instances})": (1 + instances) * CONTEXT_BYTES,
    }
    kv = (budget - sum(terms.values())) // MIB * MIB
    spent = " - ".join(f"{v / GIB:.1f} GiB {k}" for k, v in terms.items() if v)
    if kv < MIN_KV_BYTES:
        raise ValueError(f"--gpu-memory-utilization {options.gpu_memory_utilization:g}: {budget / GIB:.1f} GiB of a "
                         f"{total / GIB:.1f} GiB GPU ({free / GIB:.1f} GiB free) leave {kv / GIB:.2f} GiB for the KV "
                         f"cache after {spent}; raise it, or give --kv-cache-mb")
    per_token = config.kv_bytes_per_token(torch.float32) // 4 * llm_dtype_bytes // ranks
    usable = options.llm_max_running * config.max_position_embeddings * per_token  # every sequence at full context
    left = f"{budget / GIB:.1f} GiB ({options.gpu_memory_utilization:g} of {total / GIB:.1f} GiB, " \
           f"{free / GIB:.1f} GiB free) - {spent}"
    if kv > usable:
        kv = -(-usable // MIB) * MIB
        left = f"{options.llm_max_running} sequences at the full context of {config.max_position_embeddings} " \
               f"tokens (of {left})"
    lines.append(f"llm KV cache: {kv / GIB:.1f} GiB a GPU, about {kv // per_token:,} tokens = {left} "
                 "(--gpu-memory-utilization, or --kv-cache-mb to choose)")
    return dataclasses.replace(sized, kv_cache_bytes=kv), lines

