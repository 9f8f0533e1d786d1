"""bench/served_gpu.py measuring another tree's code (bench/served_host_time.py's base, 293e0e8) with
this tree's measurement: the same images, prompts, client and statistics.

- A tree from before the package's layers (issue #40) has the same functions under other module
  names: `install` maps this tree's names to them. Only names with the same API are mapped; a bench
  that needs more fails at its import, naming the module.
- Triton's Python stubs ignore PYTHONPATH: their `sys.path` starts with their working directory
  (the server's), then their interpreter's site-packages, where this checkout is installed
  editable. So bench/served_host_time.py runs the bench in the tree measured.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

# this tree's name -> the old tree's module holding the same functions
ALIASES = {
    "triton_vlm.families.demo": "triton_vlm.checkpoint",
    "triton_vlm.clients.client": "triton_vlm.client",
    "triton_vlm.contract.params": "triton_vlm.options",
    "triton_vlm.media.samples": "triton_vlm.samples",
    "triton_vlm.server.tritonserver": "triton_vlm.server",
}
OLD_CLI, CLI = "triton_vlm.cli", "triton_vlm.tools.cli"


def is_old(root: Path) -> bool:
    """Whether `root`'s package predates the layers (no `triton_vlm/tools/`)."""
    return not (root / "triton_vlm" / "tools").is_dir()


def cli_module(root: Path) -> str:
    """The module `python -m` runs for `root`'s command line."""
    return OLD_CLI if is_old(root) else CLI


def install(root: Path) -> None:
    """Make this tree's module names import `root`'s old modules (nothing for a tree with layers).
    `triton_vlm` must come from `root` (first on `sys.path`)."""
    if not is_old(root):
        return
    for new, old in ALIASES.items():
        module = importlib.import_module(old)
        sys.modules[new] = module
        parent, _, leaf = new.rpartition(".")
        try:  # `from triton_vlm.media import samples` reads the attribute of an old module
            setattr(importlib.import_module(parent), leaf, module)
        except ModuleNotFoundError:  # `triton_vlm.clients`: the full name alone is imported
            pass
