"""Triton Python model `vision_encoder_batch`; its adapter: triton_vlm/serving/backend/vision_encoder_batch.py."""
from triton_vlm.serving.backend.vision_encoder_batch import VisionEncoderBatchModel as TritonPythonModel  # noqa: F401
