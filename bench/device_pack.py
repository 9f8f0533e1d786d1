"""What bench/served_gpu.py needs on the device machine, which has none of it: the bundled
tritonserver and what tritonserver loads, and the wheels of tritonclient and PyAV for its Python.

    .venv/bin/python bench/device_pack.py server .device/server   # 26 MiB
    .venv/bin/python bench/device_pack.py wheels .device          # .device/tritonclient 0.1 MiB, .device/av 34 MiB

One device call carries at most 64 MiB, and what it carried stays there while the machine is warm
(30 s): the first call carries `.device/server` and `.device/tritonclient`, the next, at once,
`.device/av` and runs `bench/served_gpu.py --carried .device`.

`server`: DIR/server.tar.xz, the nvidia-pytriton wheel's layout cut down to what runs there:
`pytriton/tritonserver/bin/tritonserver`, the Python backend (its stub for `--python`, 3.12 on the
device), and of `nvidia_pytriton.libs` the libraries that tritonserver, the backend and the stub
load (their `ldd` closure within that folder; the server finds them through its RUNPATH). The
device has CUDA 13's runtime, not 12's; the wheel's own libcudart 12 comes along. `libpython3.X`
is the stub's one outside need: `unpack` says so plainly where the device's Python has none.
`wheels`: DIR/tritonclient/*.whl and DIR/av/*.whl for CPython `--python` on manylinux x86-64, the
versions installed here (pip download; the device has grpcio, protobuf and numpy).

`unpack(DIR)` (bench/served_gpu.py `--carried DIR`) extracts the server under /tmp, installs the
wheels into /tmp/site, and points `TRITON_VLM_TRITON_ROOT` and the import path at them.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

WHEELS = ("tritonclient", "av")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def _ldd_closure(files: list[Path], libs: Path) -> set[Path]:
    """The libraries of `libs` that `files` load, directly or not."""
    found: set[Path] = set()
    todo = list(files)
    while todo:
        out = subprocess.run(["ldd", str(todo.pop())], capture_output=True, text=True).stdout
        for path in re.findall(r"=> (\S+)", out):
            lib = Path(path).resolve()
            if lib.parent == libs.resolve() and lib not in found:
                found.add(lib)
                todo.append(lib)
    return found


def pack_server(dest: Path, python: str, preset: int = 6) -> Path:
    """DEST/server.tar.xz (see the module's docstring)."""
    from triton_vlm.server.tritonserver import triton_root

    root = triton_root()  # site-packages/pytriton/tritonserver
    site = root.parent.parent
    libs = site / "nvidia_pytriton.libs"
    backend = root / "backends" / "python"
    stub = root / "python_backend_stubs" / python / "triton_python_backend_stub"
    members = {root / "bin" / "tritonserver": "pytriton/tritonserver/bin/tritonserver",
               backend / "libtriton_python.so": "pytriton/tritonserver/backends/python/libtriton_python.so",
               backend / "triton_python_backend_utils.py":
                   "pytriton/tritonserver/backends/python/triton_python_backend_utils.py",
               stub: "pytriton/tritonserver/backends/python/triton_python_backend_stub"}
    for lib in sorted(_ldd_closure(list(members), libs)):
        members[lib] = f"nvidia_pytriton.libs/{lib.name}"
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / "server.tar.xz"
    with tarfile.open(archive, "w:xz", preset=preset) as tar:
        for path, name in members.items():
            tar.add(path, arcname=name)
    return archive


def pack_wheels(dest: Path, python: str) -> list[Path]:
    """DEST/NAME/*.whl for each of WHEELS, at the versions installed here (what the tests ran), one
    folder each: they are too large for one device call together."""
    from importlib.metadata import version

    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name in WHEELS:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", python, "--implementation", "cp", *platforms, "-d", str(dest / name),
                        f"{name}=={version(name)}"], check=True)
    return sorted(dest.glob("*/*.whl"))


def unpack(carried: Path, into: Path = Path("/tmp/triton-vlm-carried")) -> dict[str, str]:
    """Make what `carried` holds usable by this process and the server it starts; what was done."""
    done = {}
    archive = carried / "server" / "server.tar.xz"
    if archive.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="tar")
        root = into / "pytriton" / "tritonserver"
        os.environ["TRITON_VLM_TRITON_ROOT"] = str(root)
        missing = re.findall(r"(\S+) => not found", subprocess.run(
            ["ldd", str(root / "backends" / "python" / "triton_python_backend_stub")], capture_output=True,
            text=True).stdout)
        done["server"] = str(root) + (f"; the stub cannot find {', '.join(missing)}" if missing else "")
    wheels = sorted(carried.glob("*/*.whl"))
    if wheels:
        site = into / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *map(str, wheels)], check=True)
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        done["wheels"] = ", ".join(w.name for w in wheels)
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("server", "wheels"))
    ap.add_argument("dest")
    ap.add_argument("--python", default="3.12", help="the device's Python (its stub and wheels)")
    ap.add_argument("--preset", type=int, default=6, help="xz preset of the server archive (6: about 26 MiB, 1 min)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    made = [pack_server(Path(args.dest), args.python, args.preset)] if args.what == "server" else \
        pack_wheels(Path(args.dest), args.python)
    for path in made:
        print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
