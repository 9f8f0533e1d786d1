"""Triton Python model `llm`: the logic lives in triton_vlm; see triton_vlm/triton_backend.py."""
from triton_vlm.triton_backend import LLMModel as TritonPythonModel  # noqa: F401
