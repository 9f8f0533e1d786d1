"""Reading a checkpoint's safetensors, single-file or sharded, keeping only the tensors asked for
(or only their shapes)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch


def read_safetensors(checkpoint_dir: str | Path, rename: Callable[[str], str | None],
                     dtype: torch.dtype = torch.float32,
                     plan: Callable[[str, tuple[int, ...]], list[tuple[slice, ...]] | None] | None = None
                     ) -> dict[str, torch.Tensor]:
    """Tensors in `dtype` under the names `rename` gives; a key it maps to None is not read at all.
    `plan(name, shape)` may ask for parts of a tensor only (a tensor-parallel rank's,
    `triton_vlm.llm.distributed.sharding`): the slices listed, read alone and joined along dim 0 (`[]`: none of
    it; None: all)."""
    from safetensors import safe_open

    root = Path(checkpoint_dir)
    tensors: dict[str, torch.Tensor] = {}
    for name in _files(root):
        with safe_open(str(root / name), framework="pt") as f:
            for key in f.keys():
                new_name = rename(key)
                if new_name is None:
                    continue
                parts = plan(new_name, tuple(f.get_slice(key).get_shape())) if plan is not None else None
                if parts is None:
                    tensors[new_name] = f.get_tensor(key).to(dtype)
                elif parts:
                    view = f.get_slice(key)
                    tensors[new_name] = torch.cat([view[index] for index in parts]).to(dtype)
    return tensors


def read_shapes(checkpoint_dir: str | Path, keep: Callable[[str], bool]) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors whose names `keep` accepts, read from the safetensors headers
    (no tensor data is read)."""
    from safetensors import safe_open

    root = Path(checkpoint_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    for name in _files(root):
        with safe_open(str(root / name), framework="pt") as f:
            shapes.update((key, tuple(f.get_slice(key).get_shape())) for key in f.keys() if keep(key))
    return shapes


def _files(root: Path) -> list[str]:
    """The checkpoint's safetensors files: those its index names, else every one in the folder."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no .safetensors weights")
    return files
