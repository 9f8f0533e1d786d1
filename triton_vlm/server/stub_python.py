"""What the Python that the model stubs load must hold, checked before a server starts.

The bundled tritonserver's Python backend (Triton 2.51, python_backend r24.10) reads a BYTES tensor
through numpy's internals as numpy 1 laid them out: with numpy 2 or later every BYTES tensor is read
with a zero stride (on an H100 machine with numpy 2.5.2, the 118-byte prompt was read as length
0x72727272 and the `ensemble` stub died in `deserialize_bytes_tensor`). A server in that state
loads every model and then fails every request, so `triton-vlm serve` refuses to start instead,
naming the cause.
"""
from __future__ import annotations

import subprocess
from typing import Mapping

from triton_vlm.contract.params import PYTHON_ENV
from triton_vlm.server.errors import ServerError

FIRST_UNREADABLE = 2  # numpy's major version from which the stub misreads BYTES tensors


def stub_numpy(env: Mapping[str, str]) -> str:
    """The numpy version that the stubs' interpreter (`env[PYTHON_ENV]`, run with the server's
    environment `env`, as the stubs are) imports; ServerError when it imports none."""
    python = env[PYTHON_ENV]
    done = subprocess.run([python, "-c", "import numpy; print(numpy.__version__)"], env=dict(env),
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ServerError(f"the Python the model stubs load ({python}) cannot import numpy: {last}")
    return done.stdout.strip()


def check_stub_numpy(env: Mapping[str, str]) -> str:
    """The stubs' numpy version, or ServerError naming the cause when the stub cannot read BYTES
    tensors with it."""
    version = stub_numpy(env)
    major = version.split(".")[0]
    if major.isdigit() and int(major) >= FIRST_UNREADABLE:
        raise ServerError(
            f"the Python the model stubs load ({env[PYTHON_ENV]}, {PYTHON_ENV}) has numpy {version}: the bundled "
            f"Triton 2.51 Python backend stub reads every BYTES tensor wrong with numpy {FIRST_UNREADABLE} or later "
            f"(prompts and media arrive with garbage lengths, the ensemble's stub dies); install numpy 1.26.4 "
            f"there (pip install 'numpy<2')")
    return version
