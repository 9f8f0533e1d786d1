"""The `llm` step: a Qwen2 (M-RoPE) decoder on CPU with a per-request scheduler."""
from triton_vlm.llm.engine import Engine, GenerationOutput, IncrementalDetokenizer
from triton_vlm.llm.model import DecoderConfig, DecoderModel, KVCache
from triton_vlm.llm.sampling import SamplingParams, make_generator, sample

__all__ = ["DecoderConfig", "DecoderModel", "Engine", "GenerationOutput", "IncrementalDetokenizer", "KVCache",
           "SamplingParams", "make_generator", "sample"]
