"""Triton Python model `vision_encoder_batch` (internal, dynamically batched): see triton_vlm/triton_backend.py."""
from triton_vlm.triton_backend import VisionEncoderBatchModel as TritonPythonModel  # noqa: F401
