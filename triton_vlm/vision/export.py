"""Export a checkpoint's vision tower to ONNX (TorchScript exporter, opset 17, dynamic sizes).

The ONNX file carries what the runtime needs in its metadata (`family`, `vision_config`,
`dtype`), so `VisionEncoder` opens it without the checkpoint.
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

from triton_vlm.families import detect_family
from triton_vlm.vision import get_tower

OPSET = 17
_DTYPES = ("float32", "float16")


def export_onnx(checkpoint_dir: str | Path, out_path: str | Path, dtype: str = "float32") -> Path:
    """Write the vision tower of `checkpoint_dir` to `out_path` as ONNX and return the path.

    Inputs: `pixel_values` FP32 [N, patch_dim] and the family's metadata inputs (see the tower
    module); output `embeddings` FP32 [N / merge^2, out_hidden]. `dtype` is the compute/weight
    dtype inside the graph ("float32" or "float16"); inputs and output stay FP32.
    """
    import onnx
    import torch

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, not {dtype!r}")
    family = detect_family(checkpoint_dir).name
    tower_mod = get_tower(family)
    settings = tower_mod.read_vision_config(checkpoint_dir)
    model = tower_mod.load_tower(checkpoint_dir, getattr(torch, dtype))
    pixels, metadata = tower_mod.example_inputs(settings)
    args = (torch.from_numpy(pixels),) + tuple(torch.from_numpy(metadata[k]) for k in tower_mod.METADATA_INPUTS)

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # The TorchScript exporter is chosen on purpose (it exports this graph as is, opset 17, no
    # onnxscript needed); silence its deprecation notice.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, args, str(out_path), dynamo=False, opset_version=OPSET,
                          input_names=list(tower_mod.INPUT_NAMES), output_names=[tower_mod.OUTPUT_NAME],
                          dynamic_axes=tower_mod.dynamic_axes(), do_constant_folding=True)
    # Record what the runtime needs; large models keep their external data where it is.
    proto = onnx.load(str(out_path), load_external_data=False)
    meta = {"family": family, "vision_config": json.dumps(settings), "dtype": dtype,
            "export_seconds": f"{time.perf_counter() - start:.3f}"}
    for prop in list(proto.metadata_props):
        if prop.key in meta:
            proto.metadata_props.remove(prop)
    for key, value in meta.items():
        proto.metadata_props.add(key=key, value=value)
    onnx.save(proto, str(out_path))
    return out_path
