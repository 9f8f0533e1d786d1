"""The two calls of one GPU session, run on the device machine with its own `python3` (what
bench/device_pack.py packed here, carried there; it prints both commands with the tree's commit):

    python3 bench/device_session.py call1 .device/call1                         # about 15 s
    python3 bench/device_session.py call2 .device/call2 --tree SHA --out "$OUT"  # at most 20 s + PARTS' limits, 550 s

Call 1 reports what of the checkout arrived (files, MiB, whether the set-aside test data came),
unpacks the server to /tmp (it stays while the machine is warm; the carried folder does not)
and installs the wheels of tritonclient, python-rapidjson and numpy 1.26.4 into this Python (its
stubs ignore PYTHONPATH). Call 2, within 30 s of call 1's reply, installs PyAV and transformers,
removes scipy and scikit-learn (numpy-2 builds that transformers imports) and runs `PARTS` one after
the other, each under its own time limit, so that a part that overruns costs what comes after it
nothing but its limit, and each writes under `--out` as it goes:

- `served` (issue #37, about 200 s): bench/served_gpu.py at the 7B sizes, concurrency 1, 16, 64, an
  image of its own per request, the engine alone on the same distinct prompts (issue #38's image
  figures), a 10 s 720p video: `served-7b-*.json`, `served/server.log`, `served.log`;
- `decoder` (issue #38, about 150 s): bench/decoder.py `--decoder-7b` at concurrency 1, 16, 64
  against transformers: `decoder.json`, `decoder.log`;
- `pytest-gpu` (about 90 s): `pytest -m gpu` over the files that hold `gpu` tests, the CUDA
  engine, kernels and sampling against transformers on CUDA: `pytest-gpu.log`.

Seven files in all (the device returns at most eight).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from device_pack import SERVER_ARCHIVE, SET_ASIDE, install_wheels, unpack_server  # noqa: E402

SERVER_DIR = Path("/tmp/triton-vlm-server")  # survives between the calls while the machine is warm
NUMPY_2_BUILDS = ("scipy", "scikit-learn")
# (name, seconds at most, command after the interpreter: `expand`)
PARTS = (
    ("served", 250, ["bench/served_gpu.py", "--device", "gpu", "--size", "7b", "--concurrency", "1,16,64",
                     "--rounds", "2", "--tree", "{tree}", "--results", "{out}", "--out", "{out}/served"]),
    ("decoder", 180, ["bench/decoder.py", "--device", "cuda", "--decoder-7b", "--concurrency", "1,16,64",
                      "--rounds", "1", "--requests", "8", "--max-tokens", "64", "--json", "{out}/decoder.json"]),
    ("pytest-gpu", 120, ["-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "{gpu_tests}"]),
)


def gpu_tests() -> list[str]:
    """The test files with `gpu` tests: collecting the others would need what the machine lacks."""
    return sorted(str(p.relative_to(BENCH.parent)) for p in (BENCH.parent / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text())


def expand(args: list[str], out: Path, tree: str) -> list[str]:
    """A part's arguments with `{out}`, `{tree}` and `{gpu_tests}` filled in."""
    return [a for arg in args for a in (gpu_tests() if arg == "{gpu_tests}" else [arg.format(out=out, tree=tree)])]


def arrived(root: Path = BENCH.parent) -> dict:
    """What of the checkout reached the machine: its files and MiB, and whether the paths set aside
    for the calls (`device_pack.SET_ASIDE`) came too."""
    files = [p for p in root.rglob("*") if p.is_file() and ".device" not in p.relative_to(root).parts]
    return {"files": len(files), "mib": round(sum(p.stat().st_size for p in files) / 2**20, 1),
            "set_aside_arrived": {rel: (root / rel).exists() for rel in SET_ASIDE}}


def call1(folder: Path) -> dict:
    root, missing = unpack_server(folder / SERVER_ARCHIVE, SERVER_DIR)
    install_wheels(sorted(folder.glob("*.whl")))
    return {"server": str(root), "stub_cannot_find": missing, "numpy": _version("numpy"), "tree": arrived()}


def call2(folder: Path, tree: str, out: Path, parts: tuple = PARTS) -> dict:
    started = time.monotonic()
    install_wheels(sorted(folder.glob("*.whl")))
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *NUMPY_2_BUILDS], check=False)
    done = {"setup_s": round(time.monotonic() - started, 1), "numpy": _version("numpy"), "parts": {}}
    env = {**os.environ, "TRITON_VLM_TRITON_ROOT": str(SERVER_DIR / "pytriton" / "tritonserver"),
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    out.mkdir(parents=True, exist_ok=True)
    for name, limit, args in parts:
        command = [sys.executable, *expand(args, out, tree)]
        t0 = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            try:
                code = subprocess.run(command, cwd=BENCH.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=limit).returncode
            except subprocess.TimeoutExpired:
                code = "timed out"
        done["parts"][name] = {"exit": code, "seconds": round(time.monotonic() - t0, 1), "limit_s": limit}
        print(name, done["parts"][name], flush=True)
    return done


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("call", choices=("call1", "call2"))
    ap.add_argument("folder", help="what bench/device_pack.py packed for this call, carried here")
    ap.add_argument("--tree", default="unknown", help="call2: the commit measured (the copy has no .git)")
    ap.add_argument("--out", help="call2: where everything is written ($OUT)")
    args = ap.parse_args()
    if args.call == "call1":
        print(json.dumps(call1(Path(args.folder))))
    else:
        if not args.out:
            ap.error("call2 needs --out")
        print(json.dumps(call2(Path(args.folder), args.tree, Path(args.out))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
