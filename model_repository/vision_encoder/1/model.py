"""Triton Python model `vision_encoder`: the logic lives in triton_vlm; see triton_vlm/triton_backend.py."""
from triton_vlm.triton_backend import VisionEncoderModel as TritonPythonModel  # noqa: F401
