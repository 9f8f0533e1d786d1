"""Triton Python model `llm`; its adapter: triton_vlm/serving/backend/llm.py."""
from triton_vlm.serving.backend.llm import LLMModel as TritonPythonModel  # noqa: F401
