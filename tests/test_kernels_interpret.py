"""The llm's Triton kernels under Triton's interpreter on the CPU (tests/kernels_interpreted.py), in
a process of its own that has `TRITON_INTERPRET=1` before anything imports Triton."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_kernel_under_the_interpreter_equals_its_torch_reference():
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels_interpreted.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    summary = re.search(r"(\d+) passed", run.stdout)
    assert summary and int(summary.group(1)) == 42 and "failed" not in run.stdout.splitlines()[-1], run.stdout[-2000:]
