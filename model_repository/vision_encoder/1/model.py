"""Triton Python model `vision_encoder`; its adapter: triton_vlm/serving/backend/vision_encoder.py."""
from triton_vlm.serving.backend.vision_encoder import VisionEncoderModel as TritonPythonModel  # noqa: F401
