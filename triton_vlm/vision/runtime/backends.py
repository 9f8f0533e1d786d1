"""The vision encoder back ends `vision_encoder_batch` can run (`--encoder-backend`).

- `onnxruntime`: the ONNX export on the CPU (the CPU build's default);
- `tensorrt`: a TensorRT engine built from the export (the GPU build's default when the optional
  `tensorrt` package imports: `pip install -e .[gpu]`);
- `torch`: the family's torch tower from the checkpoint (`TorchEncoder`), on the instance's GPU
  in bfloat16 / float16, or on the CPU (the GPU build's default without `tensorrt`).

Nothing here imports `tensorrt` unless that back end is asked for.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from triton_vlm.contract.params import EncoderBatchOptions
    from triton_vlm.vision.runtime.encoder import TowerEncoder

BACKENDS = ("tensorrt", "torch", "onnxruntime")


def default_backend(device: str) -> str:
    """onnxruntime on cpu; on gpu tensorrt where its package is installed, else torch."""
    if device == "cpu":
        return "onnxruntime"
    return "tensorrt" if importlib.util.find_spec("tensorrt") is not None else "torch"


def open_encoder(options: EncoderBatchOptions, version_dir: Path, device: str) -> TowerEncoder:
    """The encoder of a built `vision_encoder_batch` (`options` from its config) on `device`
    (cpu or cuda:N, the Triton instance's)."""
    if options.backend == "tensorrt":
        from triton_vlm.vision.runtime.tensorrt_engine import TensorRTEncoder

        return TensorRTEncoder(version_dir / options.engine_file, device=int(device.partition(":")[2] or 0))
    if options.backend == "torch":
        from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

        return TorchEncoder(version_dir / options.weights_dir, device=device, dtype=options.dtype)
    from triton_vlm.vision.runtime.encoder import VisionEncoder, default_threads

    threads = options.intra_op_threads or default_threads(options.instances)
    return VisionEncoder(version_dir / options.encoder_file, intra_op_threads=threads)
