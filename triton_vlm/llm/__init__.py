"""The `llm` step: the Qwen2 / GLM-4 / Qwen3.5-hybrid (M-RoPE) decoders on CPU or CUDA in float32,
bfloat16 or float16, paged KV cache, in-flight batching."""
from triton_vlm.llm.engine import Engine, GenerationOutput, IncrementalDetokenizer
from triton_vlm.llm.model import Chunk, DecoderConfig, DecoderModel
from triton_vlm.llm.paged import KVPool
from triton_vlm.llm.sampling import SamplingParams, make_generator, sample

__all__ = ["DecoderConfig", "DecoderModel", "Engine", "GenerationOutput", "IncrementalDetokenizer", "KVPool", "Chunk",
           "SamplingParams", "make_generator", "sample"]
