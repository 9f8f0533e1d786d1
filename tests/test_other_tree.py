"""bench/other_tree.py: bench/served_gpu.py's imports reach an older tree's modules (293e0e8's
names, from before the package's layers), in a process whose `triton_vlm` is that tree's."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
OLD_MODULES = ("checkpoint", "client", "options", "samples", "server", "media", "cli")


def test_the_new_names_import_an_old_trees_modules(tmp_path):
    package = tmp_path / "triton_vlm"
    (package / "families").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "families" / "__init__.py").write_text("")
    for name in OLD_MODULES:
        (package / f"{name}.py").write_text(f"WHERE = {name!r}\n")
    probe = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
             "from pathlib import Path\nimport other_tree\nother_tree.install(Path(sys.argv[1]))\n"
             "from triton_vlm.families.demo import WHERE as demo\n"
             "from triton_vlm.clients.client import WHERE as client\n"
             "from triton_vlm.contract.params import WHERE as params\n"
             "from triton_vlm.media import samples\n"
             "from triton_vlm.server.tritonserver import WHERE as server\n"
             "print(demo, client, params, samples.WHERE, server, other_tree.cli_module(Path(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path), str(BENCH)], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["checkpoint", "client", "options", "samples", "server", "triton_vlm.cli"]


def test_a_tree_with_layers_is_left_as_it_is():
    sys.path.insert(0, str(BENCH))
    try:
        import other_tree
    finally:
        sys.path.remove(str(BENCH))
    root = BENCH.parent
    assert not other_tree.is_old(root) and other_tree.cli_module(root) == "triton_vlm.tools.cli"
