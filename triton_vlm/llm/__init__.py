"""The `llm` step: the Qwen2 / GLM-4 / Qwen3.5-hybrid (M-RoPE) decoders on CPU or CUDA in float32 / bfloat16 /
float16, paged KV cache, in-flight batching."""
from triton_vlm.llm.block_manager import BlockManager
from triton_vlm.llm.engine import Engine
from triton_vlm.llm.config import DecoderConfig
from triton_vlm.llm.model import DecoderModel
from triton_vlm.llm.output import GenerationOutput, IncrementalDetokenizer
from triton_vlm.llm.runner import ModelRunner, prompt_logits
from triton_vlm.llm.sampling import NO_TOKEN, SamplingParams, make_generator, sample_batch
from triton_vlm.llm.scheduler import Scheduler

__all__ = ["BlockManager", "DecoderConfig", "DecoderModel", "Engine", "GenerationOutput", "IncrementalDetokenizer",
           "ModelRunner", "NO_TOKEN", "SamplingParams", "Scheduler", "make_generator", "prompt_logits", "sample_batch"]
