"""`BuildOptions`: every choice of `triton-vlm build` (its flags), and where a built repository
keeps its files."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from triton_vlm.contract.limits import DEFAULT_LIMITS, Limits

SOURCE_MODELS = Path(__file__).resolve().parents[2] / "model_repository"


CHECKPOINT_DIR = "checkpoint"  # inside each model's version folder


ENCODER_FILE = "encoder.onnx"  # in vision_encoder/1/; the batched model reads it from there


ENGINE_FILE = "encoder.plan"   # --device gpu: TensorRT engine, in vision_encoder_batch/1/


# Small files every Python model may read; weights go only where they are used.
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                     "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                     "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


@dataclass(frozen=True)
class BuildOptions:
    """A field at 0 marked "sized" is chosen by the build (`triton_vlm.repository.sizing`): from the
    machine on a GPU build, else its fixed default."""
    device: str = "cpu"
    preprocess_instances: int = 0       # sized: half the cores on a GPU build (2 to 16), else 2
    limits: Limits = DEFAULT_LIMITS     # preprocess request limits (triton_vlm.contract.limits)
    encoder_instances: int = 1          # instances of the batched encoder (`vision_encoder_batch`)
    encoder_threads: int = 0            # ONNX Runtime intra-op threads; 0: the cores / encoder_instances
    # The encoder's back end (triton_vlm.vision.runtime.backends; empty: its default for the device) and
    # dtype (empty: float32; torch on gpu: bfloat16; tensorrt: --trt-precision decides).
    encoder_backend: str = ""
    encoder_dtype: str = ""
    # --device gpu: the GPUs of the llm and encoder instances, e.g. "0,1" (empty: all visible at
    # build time; [0] where none is).
    gpus: str = ""
    # instances of the light `vision_encoder` front (concurrent requests); sized: the cores on a GPU
    # build (4 to 32), else 4
    encoder_frontends: int = 0
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
    # llm: the paged KV cache pool (tokens wins over bytes; 0 and 0, sized: from each GPU's memory
    # on a GPU build, else 256 MiB), its block size, prompt-prefix block reuse, and the in-flight
    # batch (requests, rows per step; sized: 8192 with the llm on CUDA, else 512).
    kv_cache_tokens: int = 0
    kv_cache_bytes: int = 0
    kv_block_size: int = 16
    prefix_caching: bool = True
    llm_max_running: int = 64
    llm_max_num_tokens: int = 0
    # --device gpu: the share of each GPU's memory the build plans for (vLLM's gpu_memory_utilization):
    # the KV cache is what the weights, activations, graphs and encoders leave of it
    gpu_memory_utilization: float = 0.9
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
    # preprocess: the default EVS video pruning rate in [0, 1) (triton_vlm.media.evs; families that prune videos),
    # which a request's mm_options.video_pruning_rate overrides.
    video_pruning_rate: float = 0.0

