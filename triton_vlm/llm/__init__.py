"""The `llm` step: a family's decoder (`config`, `model`) on CPU or CUDA in float32 / bfloat16 /
float16, made of `layers`, attending over a paged KV cache (`attention`), split over ranks
(`distributed`), run by the in-flight batching `engine`. This face names what callers use."""
from triton_vlm.llm.config import DecoderConfig
from triton_vlm.llm.engine.block_manager import BlockManager
from triton_vlm.llm.engine.engine import Engine
from triton_vlm.llm.engine.runner import ModelRunner, prompt_logits
from triton_vlm.llm.engine.sampling import NO_TOKEN, SamplingParams, make_generator, sample_batch
from triton_vlm.llm.engine.scheduler import Scheduler
from triton_vlm.llm.engine.streaming import GenerationOutput, IncrementalDetokenizer
from triton_vlm.llm.model import DecoderModel

__all__ = ["BlockManager", "DecoderConfig", "DecoderModel", "Engine", "GenerationOutput", "IncrementalDetokenizer",
           "ModelRunner", "NO_TOKEN", "SamplingParams", "Scheduler", "make_generator", "prompt_logits", "sample_batch"]
