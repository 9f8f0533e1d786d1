"""Where a family's tower runs: `encoder.TowerEncoder` (what every runtime shares: input checks,
the plan of runs) with ONNX Runtime (`encoder.VisionEncoder`, over the graph `export` writes), the
torch tower itself (`torch_encoder`) or a TensorRT engine (`tensorrt_engine`); `backends` picks
one for `vision_encoder_batch`.
"""
