"""What the device machine needs and has not, packed here for its two calls (bench/device_session.py
runs them there), and the unpacking both sides share.

    .venv/bin/python bench/device_pack.py .device     # packs .device/call1 and .device/call2, prints the two calls
    .venv/bin/python bench/device_pack.py --aside     # before the calls: test data the GPU does not read, out
    .venv/bin/python bench/device_pack.py --restore   # after them, however they ended: put back

What the H100 taught (issue #37): a path carried by one call is gone at the next, while `/tmp` and
the machine's own Python environment stay as long as it is warm (30 s after a call); Triton's Python
backend stub ignores `PYTHONPATH` (its `sys.path` is its interpreter's own site-packages), so wheels
go into that Python itself, not a `--target` folder; the machine's numpy (2.x) makes the bundled
stub (Triton 2.51) read every BYTES tensor wrong, so numpy 1.26.4 replaces it, and the machine's
scipy and scikit-learn (numpy-2 builds, which transformers imports) go. One call carries at most
64 MiB with the tree (kept within 60 MiB, `CALL_BUDGET`; the tree without `SET_ASIDE`), hence two:

- `call1/` (about 45 MiB, and the tree): `server.tar.xz`, the nvidia-pytriton wheel's layout cut
  down to what runs there: `pytriton/tritonserver/bin/tritonserver`, the Python backend (its stub
  for `--python`, 3.12 there), and of `nvidia_pytriton.libs` the libraries that tritonserver, the
  backend and the stub load (their `ldd` closure within that folder; the server finds them through
  its RUNPATH; CUDA 12's runtime comes along, the machine has 13's); the wheels of tritonclient,
  python-rapidjson (tritonclient.grpc needs it) and numpy 1.26.4 for CPython `--python`.
- `call2/` (about 47 MiB, and the tree): the wheels of PyAV (`preprocess` decodes videos with it)
  and transformers (the version pinned here: the oracle of `pytest -m gpu`; the machine has an
  older one).

The wheels are the versions installed here (numpy's is fixed), manylinux x86-64, downloaded with
pip. `unpack_server` and `install_wheels` are what call 1 does there (`bench/served_gpu.py
--carried` unpacks a server packed here the same way).
"""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

CALLS = {"call1": ("tritonclient", "python-rapidjson", "numpy"), "call2": ("av", "transformers")}
PINNED = {"numpy": "1.26.4"}  # the newest numpy the bundled python_backend stub reads BYTES tensors with
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
SERVER_ARCHIVE = "server.tar.xz"
CARRY_LIMIT = 64 << 20  # bytes one device call carries, the tree included
CALL_BUDGET = 60 << 20  # what a pack and the tree may take: room under the limit for what the tree gains
# Test data the GPU calls do not read (the golden outputs of official code, for CPU tests), moved out
# of the checkout for the calls (`--aside`) and back after (`--restore`): what is not on disk does
# not travel. Call 1 reports what arrived (`device_session.call1`: the tree's files and bytes).
SET_ASIDE = ("tests/golden",)
ASIDE_DIR = ".device-aside"  # beside the checkout, not in it


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
    archive = dest / SERVER_ARCHIVE
    with tarfile.open(archive, "w:xz", preset=preset) as tar:
        for path, name in members.items():
            tar.add(path, arcname=name)
    return archive


def pack_wheels(dest: Path, names: tuple[str, ...], python: str) -> list[Path]:
    """DEST/*.whl of `names` for CPython `python` on manylinux x86-64, at the versions installed here
    (what the tests ran) or `PINNED`."""
    from importlib.metadata import version

    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    wanted = [f"{name}=={PINNED.get(name) or version(name)}" for name in names]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", *platforms, "-d", str(dest), *wanted],
                   check=True)
    return sorted(dest.glob("*.whl"))


def unpack_server(archive: Path, into: Path) -> tuple[Path, list[str]]:
    """The server of `archive` extracted under `into`: its root (for `TRITON_VLM_TRITON_ROOT`) and
    the libraries its Python backend stub cannot find there (`libpython3.X` is its one outside need)."""
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="tar")
    root = into / "pytriton" / "tritonserver"
    missing = re.findall(r"(\S+) => not found", subprocess.run(
        ["ldd", str(root / "backends" / "python" / "triton_python_backend_stub")], capture_output=True,
        text=True).stdout)
    return root, missing


def install_wheels(wheels: list[Path]) -> None:
    """`wheels` into this Python's own environment, the one the stubs load (they ignore PYTHONPATH)."""
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", *map(str, wheels)], check=True)


def tree_bytes(root: Path, without: tuple[str, ...] = SET_ASIDE) -> int:
    """Bytes of the files a device call sends of the checkout (tracked, and untracked not ignored,
    where they are on disk), those under `without` left out (set aside for the calls)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, check=True).stdout.split(b"\0")
    paths = [n.decode() for n in names if n]
    return sum((root / n).stat().st_size for n in paths
               if (root / n).is_file() and not any(n == w or n.startswith(w + "/") for w in without))


def set_aside(root: Path, restore: bool = False) -> list[str]:
    """`SET_ASIDE` moved from the checkout to `ASIDE_DIR` beside it, or (`restore`) back; what moved.
    Either way it is safe to repeat: a path already where it goes is left."""
    aside = root.parent / ASIDE_DIR / root.name
    moved = []
    for rel in SET_ASIDE:
        src, dst = (aside / rel, root / rel) if restore else (root / rel, aside / rel)
        if src.exists() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            src.rename(dst)
            moved.append(rel)
    return moved


def calls(dest: Path, root: Path) -> list[tuple[list[str], str]]:
    """The two device calls: (carry, command) each, the tree measured named by its commit."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()
    rel = dest.resolve().relative_to(root)
    return [([str(rel / "call1")], f"python3 bench/device_session.py call1 {shlex.quote(str(rel / 'call1'))}"),
            ([str(rel / "call2")], f"python3 bench/device_session.py call2 {shlex.quote(str(rel / 'call2'))} "
                                   f"--tree {head} --out \"$OUT\"")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", nargs="?", help="e.g. .device (a folder git ignores)")
    ap.add_argument("--aside", action="store_true", help=f"move {', '.join(SET_ASIDE)} out of the checkout "
                                                         "for the calls")
    ap.add_argument("--restore", action="store_true", help="put what --aside moved back")
    ap.add_argument("--python", default="3.12", help="the device's Python (its stub and wheels)")
    ap.add_argument("--preset", type=int, default=6, help="xz preset of the server archive (6: about 26 MiB, 1 min)")
    ap.add_argument("--server-only", action="store_true", help="only DEST/call1/server.tar.xz (tests)")
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    if args.aside or args.restore:
        print(("restored: " if args.restore else "set aside: ") + (", ".join(set_aside(root, args.restore)) or "nothing"))
        return 0
    if not args.dest:
        ap.error("the folder to pack into is needed")
    sys.path.insert(0, str(root))
    dest = Path(args.dest)
    made = {"call1": [pack_server(dest / "call1", args.python, args.preset)]}
    if not args.server_only:
        for call, names in CALLS.items():
            made.setdefault(call, []).extend(pack_wheels(dest / call, names, args.python))
    tree = tree_bytes(root)
    for call, paths in made.items():
        size = sum(p.stat().st_size for p in paths)
        print(f"{call}: {', '.join(f'{p.name} {p.stat().st_size / 2**20:.1f} MiB' for p in paths)}; "
              f"with the tree ({tree / 2**20:.1f} MiB, {', '.join(SET_ASIDE)} set aside): "
              f"{(size + tree) / 2**20:.1f} MiB, as the device tool counts it (limit {CARRY_LIMIT >> 20}, "
              f"budget {CALL_BUDGET >> 20})")
        if size + tree > CALL_BUDGET:
            print(f"  {call} is over the budget of one call: pack less", file=sys.stderr)
            return 1
    if not args.server_only:
        print(f"before the calls: python bench/device_pack.py --aside; after them, however they end: "
              f"python bench/device_pack.py --restore")
        for n, (carry, command) in enumerate(calls(dest, root), 1):
            print(f"call {n}: carry {carry}, timeout_s {600 if n == 2 else 120}:\n  {command}")
        print("call 2 within 30 s of call 1's reply (the machine stays warm that long)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
