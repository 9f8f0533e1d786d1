"""`triton-vlm serve` refuses to start, naming the cause, when the Python its model stubs load has
numpy 2 or later (the bundled Triton 2.51 stub reads every BYTES tensor wrong with it).

The environment with numpy 2 is a real virtual environment of this interpreter whose site-packages
hold a `.pth` file that adds this project's environment and then makes the numpy it imports say
2.1.3: `serve` run by its interpreter hands the stubs that interpreter, as on a machine whose numpy
was upgraded."""
from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from triton_vlm.contract.params import PYTHON_ENV
from triton_vlm.server.errors import ServerError
from triton_vlm.server.stub_python import check_stub_numpy
from triton_vlm.server.tritonserver import server_env

ROOT = Path(__file__).resolve().parent.parent


def venv(where: Path, pth: str | None = None) -> Path:
    """The interpreter of a new virtual environment of this Python, with `pth` as a .pth file."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    if pth is not None:
        purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        (Path(purelib) / "project.pth").write_text(pth)
    return python


@pytest.fixture(scope="module")
def numpy2_python(tmp_path_factory) -> Path:
    """The interpreter of a virtual environment whose numpy reports 2.1.3."""
    lines = [*site.getsitepackages(), 'import numpy; numpy.__version__ = "2.1.3"']  # .pth lines run in order
    return venv(tmp_path_factory.mktemp("numpy2") / "venv", "\n".join(lines) + "\n")


def test_the_stubs_numpy_is_read_from_their_own_environment(numpy2_python, tmp_path):
    env = server_env()
    assert check_stub_numpy(env) == __import__("numpy").__version__  # this environment's: 1.x, served
    with pytest.raises(ServerError, match=r"numpy 2\.1\.3: the bundled Triton 2\.51 Python backend stub reads "
                                          r"every BYTES tensor wrong .* install numpy 1\.26\.4"):
        check_stub_numpy({**env, PYTHON_ENV: str(numpy2_python)})
    bare = venv(tmp_path / "bare")  # no numpy at all
    with pytest.raises(ServerError, match=rf"the Python the model stubs load \({bare}\) cannot import numpy: "
                                          "ModuleNotFoundError"):
        check_stub_numpy({**env, PYTHON_ENV: str(bare), "PYTHONPATH": ""})


def test_serve_refuses_to_start_with_numpy_2_in_the_stubs_python(numpy2_python, tmp_path):
    done = subprocess.run([str(numpy2_python), "-m", "triton_vlm.tools.cli", "serve", "--repo", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, done.stderr
    assert f"the Python the model stubs load ({numpy2_python}, {PYTHON_ENV}) has numpy 2.1.3" in done.stderr
    assert "Started GRPCInferenceService" not in done.stderr + done.stdout  # no server was started
