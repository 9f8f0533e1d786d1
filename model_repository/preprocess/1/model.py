"""Triton Python model `preprocess`: the logic lives in triton_vlm; see triton_vlm/triton_backend.py."""
from triton_vlm.triton_backend import PreprocessModel as TritonPythonModel  # noqa: F401
