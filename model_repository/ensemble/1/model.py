"""Triton Python model `ensemble`: the logic lives in triton_vlm; see triton_vlm/triton_backend.py."""
from triton_vlm.triton_backend import PipelineModel as TritonPythonModel  # noqa: F401
