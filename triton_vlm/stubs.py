"""The Python-backend stub processes of a tritonserver, and a watcher of their deaths.

Triton 2.51 neither restarts a stub that dies nor ends the requests a decoupled one held: they
wait for responses that never come (server issue 7862). Two parties watch the stubs with a
`StepWatch`: the server's supervisor (`triton_vlm.supervisor`, which reloads the model, or
restarts the server) and the `ensemble`, which ends the requests it has in flight through a step
that died, so that its clients get UNAVAILABLE at once instead of hanging.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger("triton_vlm")


def stub_processes(server_pid: int) -> dict[int, str]:
    """pid -> model instance name (`llm_0_0`) of the Python backend stubs of `server_pid`."""
    stubs = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
            stat = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == server_pid and argv[0].endswith(b"triton_python_backend_stub"):
            stubs[int(cmdline.parent.name)] = argv[-3].decode()  # ... INSTANCE_NAME DEFAULT ''
    return stubs


def model_of(instance: str) -> str:
    """The model of an instance name (`vision_encoder_batch_0_1` -> `vision_encoder_batch`)."""
    return instance.rsplit("_", 2)[0]


class StepWatch:
    """Calls `on_death(instance, pid)` from its own thread, within `period` seconds, when a stub on
    `server_pid` of a model not in `ignore` dies; the model's other stubs, which its reload
    retires, are not counted again. Stubs that start later are watched from then on.
    `down(model)`: a stub of it died and, since, no new stub of it started that `ready(model)`
    says is ready (a request sent to it meanwhile would wait for a dead stub, or for its reload)."""

    def __init__(self, server_pid: int, ignore: set[str], on_death: Callable[[str, int], None],
                 ready: Callable[[str], bool], period: float = 0.2) -> None:
        self.server_pid, self.ignore, self.on_death, self.period = server_pid, ignore, on_death, period
        self.ready = ready
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._down: dict[str, set[int]] = {}  # model -> its stubs when it died (none of them serves again)
        self._retiring: set[int] = set()  # the other stubs of a model that died: its reload ends them
        self._known = self._stubs()
        self._thread = threading.Thread(target=self._run, name="step-watch", daemon=True)
        self._thread.start()

    def _stubs(self) -> dict[int, str]:
        """pid -> instance name of the watched stubs."""
        return {pid: instance for pid, instance in stub_processes(self.server_pid).items()
                if model_of(instance) not in self.ignore}

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._scan()
            except Exception:  # the watcher must outlive surprises in /proc and in callbacks
                log.exception("step watch failed")

    def _scan(self) -> None:
        alive = self._stubs()
        for pid, instance in self._known.items():
            if pid in alive:
                continue
            if pid in self._retiring:  # the reload of an earlier death retires it
                self._retiring.discard(pid)
                continue
            model = model_of(instance)
            others = {p for p, i in alive.items() if model_of(i) == model and p in self._known}
            with self._lock:
                self._down[model] = {pid} | others | self._down.get(model, set())
            self._retiring |= others
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
