"""Starting and stopping the bundled `tritonserver` (from the nvidia-pytriton wheel).

The Python backend stub runs models with this interpreter's packages: `PATH` starts at this
environment's `bin`, `LD_LIBRARY_PATH` at this interpreter's own libpython (otherwise the stub
picks up the system's older libpython and `import ssl` fails inside models), and `PYTHONPATH`
names this environment's site-packages and the project, so `triton_vlm` imports there too.
"""
from __future__ import annotations

import collections
import os
import re
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Triton's error lines look like `E1122 10:30:00.123 123 file.cc:42] "message"`.
_ERROR_LINE = re.compile(r"^E\d{4} ")


def triton_root() -> Path:
    import pytriton

    return Path(pytriton.__file__).parent / "tritonserver"


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    paths = [str(PROJECT_ROOT), *site.getsitepackages()]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH", "")] if p])
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """The server exited or never became ready; the message holds its own error lines."""


class TritonServer:
    """A running tritonserver on a repository; a context manager that always stops what it started."""

    def __init__(self, repo: str | Path, http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, log_file: str | Path | None = None, echo: bool = False,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.repo = Path(repo).resolve()
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_file, self.echo, self.extra_args = log_file, echo, extra_args
        self.process: subprocess.Popen | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=400)
        self._reader: threading.Thread | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        root = triton_root()
        return [str(root / "bin" / "tritonserver"), f"--model-repository={self.repo}",
                f"--backend-directory={root / 'backends'}", f"--http-port={self.http_port}",
                f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
                "--allow-cpu-metrics=true", "--exit-timeout-secs=10", "--log-verbose=0", *self.extra_args]

    def _read_output(self) -> None:
        log = open(self.log_file, "a") if self.log_file else None
        try:
            for line in self.process.stdout:
                self._tail.append(line)
                if log:
                    log.write(line)
                    log.flush()
                if self.echo:
                    sys.stderr.write(line)
        finally:
            if log:
                log.close()

    def errors(self) -> str:
        """The server's own error lines so far (or its last lines when it printed none)."""
        lines = [l.rstrip() for l in self._tail if _ERROR_LINE.match(l)]
        return "\n".join(lines or [l.rstrip() for l in list(self._tail)[-20:]])

    def start(self, timeout: float = 300.0) -> "TritonServer":
        self.process = subprocess.Popen(self.command(), env=server_env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._reader.join(timeout=5)
                raise ServerError(f"tritonserver exited with code {self.process.returncode}:\n{self.errors()}")
            if self.is_ready():
                return self
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"tritonserver not ready after {timeout:.0f} s:\n{self.errors()}")

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def forward_signal(self, signum: int) -> None:
        """Pass a signal on to the server (safe inside a signal handler: it does not wait)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self) -> int:
        """Wait for the server to exit by itself; its exit code."""
        code = self.process.wait()
        if self._reader:
            self._reader.join(timeout=5)
        return code

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if self._reader:
            self._reader.join(timeout=5)

    def __enter__(self) -> "TritonServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
