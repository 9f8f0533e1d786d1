"""Starting and stopping the bundled `tritonserver` (from the nvidia-pytriton wheel).

The Python backend stub runs models with this interpreter's packages: `PATH` starts at this
environment's `bin`, `LD_LIBRARY_PATH` at this interpreter's own libpython (otherwise the stub
picks up the system's older libpython and `import ssl` fails inside models), and `PYTHONPATH`
names this environment's site-packages and the project, so `triton_vlm` imports there too.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import secrets
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
from typing import Callable

from triton_vlm.contract.params import PYTHON_ENV, URL_ENV
from triton_vlm.server import admin, reaper
from triton_vlm.server.errors import Aborted, NotReady, ServerError
from triton_vlm.server.process_tree import SHM_DIR, SHM_PREFIX
from triton_vlm.server.stubs import STUB_EXITS_ENV, dump_stacks, model_of, stub_processes
from triton_vlm.server.supervisor import RETIRE_S, Supervisor

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Seconds from a stop signal to a server gone: tritonserver waits for requests in flight for the
# first EXIT_TIMEOUT_S - STOP_GRACE_S (`--exit-timeout-secs`), and a server still there at
# EXIT_TIMEOUT_S is killed with its stubs: Triton 2.51 never releases the requests a dead stub
# held, so after a stub died it always waits its whole drain, and then may hang.
EXIT_TIMEOUT_S = 10
STOP_GRACE_S = 3
# Triton's error lines look like `E1122 10:30:00.123 123 file.cc:42] "message"`.
_ERROR_LINE = re.compile(r"^E\d{4} ")


# Where tritonserver's tree is, when not in the nvidia-pytriton wheel (bench/device_pack.py).
ROOT_ENV = "TRITON_VLM_TRITON_ROOT"


def triton_root() -> Path:
    if os.environ.get(ROOT_ENV):
        return Path(os.environ[ROOT_ENV])
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
    # The interpreter a model's own processes run (the llm's tensor-parallel ranks): inside a stub
    # sys.executable is the stub.
    env[PYTHON_ENV] = sys.executable
    # Every stub's OpenMP workers (torch's) spin 1000 rounds, not libgomp's 300000, before they
    # sleep: the models share the cores, and a spinning llm worker took them from preprocess and
    # the encoder (2 cores: image requests at concurrency 4, 26 -> 43 req/s; bench/RESULTS.md).
    env.setdefault("GOMP_SPINCOUNT", "1000")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What tritonserver binds when not told (its `--grpc-address`, `--http-address`, `--metrics-address`
# default): every IPv4 address of the machine.
ANY_HOST = "0.0.0.0"


def connect_host(host: str) -> str:
    """The address a client on this machine reaches a server bound to `host` at (`host:port` form)."""
    if host in ("", ANY_HOST):
        return "127.0.0.1"
    if ":" in host:  # IPv6: the wildcard's loopback, or the address itself, in brackets
        return "[::1]" if host == "::" else f"[{host}]"
    return host


def port_in_use(port: int, host: str = ANY_HOST) -> bool:
    """Whether something listens on `port` at `host` (or at an address overlapping it).

    The probe binds with SO_REUSEADDR, as tritonserver's own sockets do: a port whose last server
    is gone but whose connections are still in TIME_WAIT is free for tritonserver, and so for us;
    a listening socket still refuses the bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


class TritonServer:
    """A running tritonserver on a repository; a context manager that always stops what it started.

    Each start of the server has a reaper process (`triton_vlm.server.reaper`): when this process
    dies without stopping it (SIGKILL, a killed test run), the server gets SIGTERM and shuts down
    as on `stop`; whenever the server ends, what is left of its processes is killed and its
    shared-memory regions are removed.

    `supervise` (as `triton-vlm serve` runs it): a `Supervisor` reloads a model whose stub died
    and starts the server again when it exits by itself (`triton_vlm.server.supervisor`); it does
    so too when the old instances of a reloaded model are still there `retire_s` after the reload.

    Its admin APIs answer only requests with `admin_key` (`triton_vlm.server.admin`; default: a random
    key of this start, held by this object alone)."""

    def __init__(self, repo: str | Path, http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, log_file: str | Path | None = None, echo: bool = False,
                 extra_args: tuple[str, ...] = (), supervise: bool = False,
                 report: Callable[[str], None] | None = None, admin_key: str | None = None,
                 retire_s: float = RETIRE_S, host: str = ANY_HOST) -> None:
        self.repo = Path(repo).resolve()
        self.host = host  # what the gRPC, HTTP and metrics endpoints bind
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_file, self.echo, self.extra_args = log_file, echo, extra_args
        self.process: subprocess.Popen | None = None
        self.stub_exits = ""  # this start's (`_launch`)
        self._tail: collections.deque[str] = collections.deque(maxlen=2000)
        self._lines = 0  # read so far
        self._reader: threading.Thread | None = None
        self.supervise, self.retire_s = supervise, retire_s
        self.report = report or (lambda message: print(f"triton-vlm serve: {message}", file=sys.stderr, flush=True))
        self.events: list[str] = []
        self._stopping = threading.Event()
        self._stop_deadline = float("inf")
        self._reaper: subprocess.Popen | None = None
        self._supervisor: Supervisor | None = None
        self._start_timeout = 300.0
        self.admin_key = admin.new_key() if admin_key is None else admin.check_key(admin_key)

    @property
    def grpc_url(self) -> str:
        return f"{connect_host(self.host)}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{connect_host(self.host)}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.metrics_port}/metrics"

    def bound(self) -> str:
        """What the endpoints bind, as tritonserver is told it: `gRPC 0.0.0.0:8001, HTTP ...`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return ", ".join(f"{name} {host}:{port}" for name, port in
                         (("gRPC", self.grpc_port), ("HTTP", self.http_port), ("metrics", self.metrics_port)))

    def command(self, shm_prefix: str) -> list[str]:
        """The server's command line; its stubs' shared-memory regions are named `shm_prefix`..."""
        root = triton_root()
        return [str(root / "bin" / "tritonserver"), f"--model-repository={self.repo}",
                f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
                f"--backend-directory={root / 'backends'}", f"--http-address={self.host}",
                f"--http-port={self.http_port}", f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                "--allow-cpu-metrics=true", f"--exit-timeout-secs={EXIT_TIMEOUT_S - STOP_GRACE_S}", "--log-verbose=0",
                *admin.restricted_args(self.admin_key),
                *(("--model-control-mode=explicit", "--load-model=*") if self.supervise else ()), *self.extra_args]

    def _read_output(self) -> None:
        log = open(self.log_file, "a") if self.log_file else None
        try:
            for line in self.process.stdout:
                self._tail.append(line)
                self._lines += 1
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
        # Readiness is asked over HTTP: a server already on these ports would answer for ours (and
        # the supervisor would reload *its* models when ours exits), so refuse to start beside it.
        busy = [f"{name} port {port}" for name, port in (("HTTP", self.http_port), ("gRPC", self.grpc_port),
                                                          ("metrics", self.metrics_port)) if port_in_use(port, self.host)]
        if busy:
            raise ServerError(f"{', '.join(busy)} already in use at {self.host} (another server?)")
        self._start_timeout = timeout
        if self.supervise:  # it watches each start's stubs from the start's launch
            self._supervisor = Supervisor(self, retire_s=self.retire_s)
        try:
            self._first_launch()
        except BaseException:
            if self._supervisor is not None:
                self._supervisor.close()
                self._supervisor = None
            raise
        if self._supervisor is not None:
            self._supervisor.begin()
        return self

    def _first_launch(self) -> None:
        try:
            self._launch()
        except (NotReady, Aborted) as error:
            if not self.supervise:
                raise
            # python_backend r24.10 may leave a stub waiting for its initialize message for good
            # (seen in CI), or abort (`Aborted`): a supervised server gets one more start
            self.event(f"{error}\nstarting it again")
            self._launch()

    def relaunch(self) -> None:
        """Start the server again on the same ports, once it exited (`Supervisor`, from the thread
        that then waits for it)."""
        self._after_exit()
        self._launch()

    def _launch(self) -> None:
        # the ensemble calls its steps over this server's gRPC endpoint (triton_vlm.serving.loopback)
        env = {**server_env(), URL_ENV: self.grpc_url}
        # a prefix of this start's own: its reaper removes exactly its regions (triton_vlm.server.reaper),
        # and the markers its stubs leave as they end by themselves (triton_vlm.server.stubs)
        # (in a folder only this user may write to: a marker forged by another would hide a death)
        shm_prefix = f"{SHM_PREFIX}_{secrets.token_hex(6)}_"
        (exits := SHM_DIR / f"{shm_prefix}exited").mkdir(mode=0o700)
        self.stub_exits = env[STUB_EXITS_ENV] = f"{exits}/"
        self.process = subprocess.Popen(self.command(shm_prefix), env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reaper = reaper.start(self.process, EXIT_TIMEOUT_S, shm_prefix)
        if self._supervisor is not None:
            self._supervisor.launched(self.process)
        if self._stopping.is_set():  # a stop that came while no process was there to take it
            self.process.send_signal(signal.SIGTERM)
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            if (code := self.process.poll()) is not None:
                self._after_exit()
                error = Aborted if code < 0 and not self._stopping.is_set() else ServerError
                raise error(f"tritonserver exited with code {code}:\n{self.errors()}")
            if self.is_ready():
                return
            time.sleep(0.5)
        report = self.hang_report()
        self._kill(self.process)
        self._after_exit()
        raise NotReady(f"tritonserver not ready after {self._start_timeout:.0f} s; {report}")

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stub_processes(self) -> dict[int, str]:
        """pid -> model instance name of the server's Python backend stubs."""
        return stub_processes(self.process.pid)

    def hang_report(self, models: set[str] | None = None) -> str:
        """What a start or a reload that does not end waits for: the models' states, the server's
        last lines, and where its stubs (those of `models`, or all) are: their Python stacks, which
        they print to the server's output, and their main threads' native stacks."""
        states = self.model_states() or "index unreadable (a server starting listens once its first models loaded)"
        stubs = {pid: name for pid, name in self.stub_processes().items() if models is None or model_of(name) in models}
        tail = "\n".join(line.rstrip() for line in list(self._tail)[-30:])
        printed = self._lines
        native = dump_stacks(sorted(stubs), server_pid=self.process.pid)
        time.sleep(1.0)  # for the last stack's lines to be read
        lines = list(self._tail)
        since = lines[len(lines) - min(self._lines - printed, len(lines)):]  # what the stubs printed
        stacks = "\n".join(line.rstrip() for line in since)
        return (f"models: {states}; stubs: {sorted(stubs.values())}; its last lines:\n{tail}\n"
                f"-- the stubs' Python stacks:\n{stacks}\n-- {native}")

    def model_states(self) -> dict[str, str]:
        """Each model's state in the repository index (none if it cannot be read)."""
        request = urllib.request.Request(f"http://{self.http_url}/v2/repository/index", data=b"{}", method="POST",
                                         headers=admin.headers(self.admin_key))
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return {entry.get("name"): entry.get("state") for entry in json.loads(response.read())}
        except (OSError, ValueError, AttributeError):
            return {}

    def event(self, message: str) -> None:
        self.events.append(message)
        self.report(message)

    def forward_signal(self, signum: int) -> None:
        """Pass a signal on to the server (safe inside a signal handler: it does not wait); `wait`
        kills it if it has not exited EXIT_TIMEOUT_S seconds after."""
        if not self._stopping.is_set():
            self._stop_deadline = time.monotonic() + EXIT_TIMEOUT_S
        self._stopping.set()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    @property
    def start_timeout(self) -> float:
        """Seconds a start may take (`start`'s timeout); the supervisor gives a reload as long."""
        return self._start_timeout

    @property
    def stopping(self) -> bool:
        """Whether a stop was asked (`stop`, `forward_signal`): the supervisor restarts nothing then."""
        return self._stopping.is_set()

    def wait(self) -> int:
        """Wait for the server to exit, through the supervisor's restarts; its exit code. Once a
        stop signal was forwarded, a server still there EXIT_TIMEOUT_S after it is killed with its
        stubs."""
        while True:
            process = self.process
            while True:
                try:
                    code = process.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    if self._stopping.is_set() and time.monotonic() > self._stop_deadline:
                        self.event(f"tritonserver still running {EXIT_TIMEOUT_S} s after the "
                                   f"stop signal: killed")
                        self._kill(process)
            if self._supervisor is None or not self._supervisor.replaced(process):
                break
        self._after_exit()
        return code

    def stop(self, timeout: float = 30.0, kill: bool = False) -> None:
        """Shut the server down (SIGINT: it unloads every model, a stub after another), killing it
        with its stubs after `timeout` s; at once with `kill`, for whom a graceful end is no use
        (a test's server): its reaper removes what its stubs leave either way."""
        self._stopping.set()
        if self.process is None:
            return
        while True:
            process = self.process
            if process.poll() is None:
                if not kill:
                    process.send_signal(signal.SIGINT)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(timeout=timeout)
                if process.poll() is None:
                    self._kill(process)
            if self._supervisor is not None:  # a restart under way sees the stop and ends
                self._supervisor.done.wait(self._start_timeout)
            if self.process is process:
                break
        self._after_exit()

    @staticmethod
    def _kill(process: subprocess.Popen) -> None:
        """SIGKILL to a server and its stubs (its process group), and wait for it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def _after_exit(self) -> None:
        """Once the server has exited: its reaper has cleaned up after it, and its output is read."""
        if self._reaper is not None:
            self._reaper.wait()
        if self._reader:
            self._reader.join(timeout=5)

    def __enter__(self) -> "TritonServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

