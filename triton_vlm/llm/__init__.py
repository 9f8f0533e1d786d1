"""The `llm` step: the Qwen2 / GLM-4 / Qwen3.5-hybrid (M-RoPE) decoders on CPU, paged KV cache, in-flight batching."""
from triton_vlm.llm.engine import Engine, GenerationOutput, IncrementalDetokenizer
from triton_vlm.llm.model import Chunk, DecoderConfig, DecoderModel
from triton_vlm.llm.paged import KVPool
from triton_vlm.llm.sampling import NO_TOKEN, SamplingParams, make_generator, sample_batch

__all__ = ["DecoderConfig", "DecoderModel", "Engine", "GenerationOutput", "IncrementalDetokenizer", "KVPool", "Chunk",
           "NO_TOKEN", "SamplingParams", "make_generator", "sample_batch"]
