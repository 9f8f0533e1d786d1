"""Where and in which dtype the `llm` decoder runs: the one parser of the device and dtype names
(the Engine, the DecoderModel and the build's `llm_device` / `llm_dtype` options all go through it)."""
from __future__ import annotations

import re

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_device(device: str | torch.device) -> torch.device:
    """cpu, cuda or cuda:N, or ValueError."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", str(device)):
        raise ValueError(f"llm device {str(device)!r}: expected cpu, cuda or cuda:N")
    return torch.device(device)


def parse_dtype(dtype: str | torch.dtype, what: str = "llm dtype") -> torch.dtype:
    """float32, bfloat16 or float16, by name or as the torch dtype, or ValueError naming `what`."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"{what} {dtype!r}: expected {', '.join(DTYPES)}")


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def default_dtype(device: torch.device) -> torch.dtype:
    """The build's dtype when `llm_dtype` is left empty: float32 on CPU, bfloat16 on CUDA."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16
