"""Triton Python model `ensemble`; its adapter: triton_vlm/serving/backend/ensemble.py."""
from triton_vlm.serving.backend.ensemble import PipelineModel as TritonPythonModel  # noqa: F401
