#!/usr/bin/env bash
# `make setup`: the project virtual environment, the Triton Python backend stub for this
# interpreter, the perf_analyzer runtime and genai-perf. Idempotent: each step is skipped when done.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
# Installed again whenever pyproject.toml changes (its hash is kept in the venv).
STAMP=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -x .venv/bin/triton-vlm ] || [ "$(cat .venv/.pyproject.sha256 2>/dev/null)" != "$STAMP" ]; then
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e .
  echo "$STAMP" > .venv/.pyproject.sha256
fi
# The stub must match the running interpreter's minor version.
.venv/bin/python - <<'PY'
import shutil, sys
from pathlib import Path
import pytriton
root = Path(pytriton.__file__).parent / "tritonserver"
version = f"{sys.version_info.major}.{sys.version_info.minor}"
src = root / "python_backend_stubs" / version / "triton_python_backend_stub"
dst = root / "backends" / "python" / "triton_python_backend_stub"
if not dst.exists() or dst.read_bytes() != src.read_bytes():
    shutil.copy2(src, dst)
print(f"tritonserver: {root / 'bin' / 'tritonserver'} (python stub {version})")
PY
bash scripts/perf_analyzer_runtime.sh .pa-runtime
bash scripts/genai_perf_env.sh .genai-perf .pa-runtime
