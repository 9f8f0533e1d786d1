"""The Python-backend stub processes of a tritonserver, and a watcher of their deaths.

Triton 2.51 neither restarts a stub that dies nor ends the requests a decoupled one held: they
wait for responses that never come (server issue 7862). Two parties watch the stubs with a
`StepWatch`: the server's supervisor (`triton_vlm.server.supervisor`, which reloads the model, or
restarts the server) and the `ensemble`, which ends the requests it has in flight through a step
that died, so that its clients get UNAVAILABLE at once instead of hanging.

A stub that ends because its model is unloaded (an operator's unload, a reload, the server's own
stop) leaves a marker as it exits (`note_exit`, from `triton_vlm.server.stub_watch`): one that
vanishes without one died. Telling them apart by what else was going on (stubs of one load start
within a second, so the dead one's siblings were the ones a reload retires) failed under load:
on 2 busy cores one load's instances started seconds apart, each sibling's exit read as a new
death and its model was reloaded over and over.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger("triton_vlm")


def proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (state, ppid, ...: field N of proc(5) is at
    index N - 3); OSError if the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def stub_processes(server_pid: int) -> dict[int, str]:
    """pid -> model instance name (`llm_0_0`) of the Python backend stubs of `server_pid`'s model
    instances. Not the stub Triton runs first, named after the model, to read its config: it ends
    when it has, before the instances start."""
    stubs = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
            stat = proc_stat(int(cmdline.parent.name))
        except OSError:
            continue
        if int(stat[1]) != server_pid or not argv[0].endswith(b"triton_python_backend_stub") or len(argv) < 4:
            continue
        # STUB REPOSITORY/MODEL/VERSION/model.py ... INSTANCE_NAME DEFAULT ''
        instance, path = argv[-3].decode(), Path(argv[1].decode()).parts
        if len(path) < 3 or instance != path[-3]:
            stubs[int(cmdline.parent.name)] = instance
    return stubs


def dump_stacks(pids: list[int], server_pid: int | None = None, timeout: float = 20.0) -> str:
    """Where each stub in `pids` is: SIGUSR1 makes it print its threads' Python stacks to the
    server's output (`triton_vlm.serving.backend.pb` registers it); the native stack of its main
    thread, and those of the server's threads in the Python backend (`server_pid`), from gdb where
    it is installed, are returned."""
    native = []
    for pid in pids:
        if _catches(pid, signal.SIGUSR1):  # not yet (it is starting): the signal would kill it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
    gdb = shutil.which("gdb")
    for pid in pids if gdb else ():
        try:
            out = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply 1 bt 30"],
                                 capture_output=True, text=True, timeout=timeout).stdout
        except subprocess.TimeoutExpired:
            out = "gdb timed out"
        frames = [line[:160] for line in out.splitlines() if line.startswith("#")]
        native.append(f"stub {pid} main thread:\n" + "\n".join(frames or [out.strip()[-500:]]))
    if gdb and server_pid is not None:
        native.append(_backend_threads(gdb, server_pid, timeout))
    return "\n".join(native)


def _backend_threads(gdb: str, server_pid: int, timeout: float) -> str:
    """The native stacks of the server's threads that are in the Python backend's code."""
    try:
        out = subprocess.run([gdb, "-p", str(server_pid), "-batch", "-nx", "-ex", "thread apply all bt 25"],
                             capture_output=True, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        return "server: gdb timed out"
    threads = [t for t in out.split("\nThread ")[1:] if "backend::python" in t]
    return f"server {server_pid}, its threads in the Python backend:\n" + "\n".join(
        "Thread " + "\n".join(line[:160] for line in t.splitlines() if line.startswith(("#", " ")) or "LWP" in line)
        for t in threads[:12])


# Where a server's stubs mark their ends (a path prefix: `TritonServer` gives each start a folder of
# its own, named after its shared-memory prefix, so that its reaper removes it with its regions).
STUB_EXITS_ENV = "TRITON_VLM_STUB_EXITS"


def exit_marker(prefix: str, pid: int, started: int) -> Path:
    """The marker of stub `pid` (that started at `started` clock ticks: pids are reused)."""
    return Path(f"{prefix}{pid}_{started}")


def note_exit() -> None:
    """Called by a stub as it ends by itself: mark it (a stub outside `TritonServer` marks nothing)."""
    prefix = os.environ.get(STUB_EXITS_ENV)
    if prefix:
        with contextlib.suppress(OSError):
            exit_marker(prefix, os.getpid(), start_ticks(os.getpid())).touch()


def start_ticks(pid: int) -> int:
    """When `pid` started, in clock ticks since boot (0 if it is gone)."""
    try:
        return int(proc_stat(pid)[19])
    except (OSError, IndexError, ValueError):
        return 0


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (signum - 1) & 1)


def model_of(instance: str) -> str:
    """The model of an instance name (`vision_encoder_batch_0_1` -> `vision_encoder_batch`)."""
    return instance.rsplit("_", 2)[0]


class StepWatch:
    """Calls `on_death(instance, pid)` from its own thread, within `period` seconds, when a stub on
    `server_pid` of a model not in `ignore` ends without the marker of an end of its own (the path
    prefix `exits`, default the environment's `STUB_EXITS_ENV`). Stubs that start later are watched
    from then on. `down(model)`: a stub of it died and, since, no new stub of it started that
    `ready(model)` says is ready (a request sent to it meanwhile would wait for a dead stub, or for
    its reload)."""

    def __init__(self, server_pid: int, ignore: set[str], on_death: Callable[[str, int], None],
                 ready: Callable[[str], bool], period: float = 0.2, exits: str | None = None) -> None:
        self.server_pid, self.ignore, self.on_death, self.period = server_pid, ignore, on_death, period
        self.ready = ready
        self.exits = exits if exits is not None else os.environ.get(STUB_EXITS_ENV, "")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._scanning = threading.Lock()  # a scan, or a `learn`, at a time
        self._down: dict[str, set[int]] = {}  # model -> its stubs when it died (none of them serves again)
        self._known: dict[int, str] = {}
        self._born: dict[int, int] = {}  # pid -> its start, in clock ticks
        self._known = self._look()
        self._thread = threading.Thread(target=self._run, name="step-watch", daemon=True)
        self._thread.start()

    def _stubs(self) -> dict[int, str]:
        """pid -> instance name of the watched stubs."""
        return {pid: instance for pid, instance in stub_processes(self.server_pid).items()
                if model_of(instance) not in self.ignore}

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                with self._scanning:
                    self._scan()
            except Exception:  # the watcher must outlive surprises in /proc and in callbacks
                log.exception("step watch failed")

    def _look(self) -> dict[int, str]:
        """The stubs alive now; the start of each new one is noted."""
        alive = self._stubs()
        for pid in alive.keys() - self._known.keys():
            self._born[pid] = start_ticks(pid)
        return alive

    def learn(self) -> None:
        """Know the stubs alive now at once, not at the next scan: one that dies right after is
        seen (its death is told by the next scan)."""
        with self._scanning:
            self._known = {**self._known, **self._look()}

    def _scan(self) -> None:
        alive = self._look()
        for pid, instance in self._known.items():
            if pid in alive:
                continue
            born = self._born.pop(pid, 0)
            if self.exits and exit_marker(self.exits, pid, born).exists():  # it ended by itself
                continue
            model = model_of(instance)
            # none of the model's stubs now serves again: its reload retires them
            others = {p for p, i in alive.items() if model_of(i) == model}
            with self._lock:
                self._down[model] = {pid} | others | self._down.get(model, set())
            self.on_death(instance, pid)
        self._known = alive
        for model in list(self._down):
            self._back(model, alive)

    def _back(self, model: str, alive: dict[int, str]) -> bool:
        """Whether `model` serves again (a stub of it newer than its death is ready); if so, it is
        no longer down."""
        with self._lock:
            old = self._down.get(model)
        if old is None:
            return True
        if not any(model_of(i) == model and pid not in old for pid, i in alive.items()) or not self.ready(model):
            return False
        with self._lock:
            self._down.pop(model, None)
        return True

    def down(self, model: str) -> bool:
        """Asked per request: while `model` is down, it is looked at again now (a reload may have
        ended since the last scan)."""
        with self._lock:
            if model not in self._down:
                return False
        return not self._back(model, self._stubs())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
