"""Triton Python model `preprocess`; its adapter: triton_vlm/serving/backend/preprocess.py."""
from triton_vlm.serving.backend.preprocess import PreprocessModel as TritonPythonModel  # noqa: F401
