"""What `triton-vlm serve` does for a running tritonserver that Triton 2.51 does not: it keeps the
models, and the server itself, serving after a crash.

- A Python stub that dies leaves Triton ready, with every request routed to that instance failing
  ("Stub process ... is not healthy") and no restart: its model is reloaded (unload, then load).
  Its other instances, the old version's, end once that version unloads, which Triton does only
  when all of its requests have ended: one the dead stub held may never end, and the old stubs,
  their regions and the server's threads for them stayed for good (seen in an hour's soak). Old
  stubs still there `retire_s` after the reload (default RETIRE_S) get the server restarted (a
  steady 1 in 5 kills of a busy step's stub in tests/test_step_faults.py); the wait runs on a
  thread of its own, so that other deaths meanwhile are handled at once.
- The `ensemble`'s stub is the exception. Triton holds forever the requests a decoupled model had
  when its stub died (server issue 7862), and no reload ends them; the server is killed, which
  ends every connection at once (a gRPC client gets UNAVAILABLE), and started again.
- A tritonserver that exits by itself is started again on the same ports (python_backend r24.10
  once aborted, `boost::interprocess::lock_exception`, after a stub was killed holding a mutex of
  the shared memory), and so is one whose restart aborted or never became ready.
At most MAX_RESTARTS restarts within RESTART_WINDOW_S: past them the server stays down and `wait`
returns its exit code, for what runs `triton-vlm serve` (Kubernetes, systemd) to act on.
"""
from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Protocol

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from triton_vlm.server import admin
from triton_vlm.server.errors import Aborted, NotReady, ServerError
from triton_vlm.server.stubs import StepWatch, model_of, start_ticks

# Models whose stub's death restarts the server: the clients' entry point.
RESTART_ON_DEATH = frozenset({"ensemble"})
MAX_RESTARTS, RESTART_WINDOW_S = 5, 300.0
# Seconds a reloaded model's old instances may take to end: their requests' own time, several times over.
RETIRE_S = 60.0
# Seconds from a server that dropped its connections (an abort) to its exit, seen.
EXIT_SEEN_S = 5.0


class Supervised(Protocol):
    """What the supervisor needs of the server it watches (`tritonserver.TritonServer`)."""
    process: subprocess.Popen
    admin_key: str
    stub_exits: str  # where its stubs mark their own ends (`triton_vlm.server.stubs.StepWatch`)

    @property
    def grpc_url(self) -> str: ...
    @property
    def start_timeout(self) -> float: ...
    @property
    def stopping(self) -> bool: ...
    def relaunch(self) -> None: ...
    def event(self, message: str) -> None: ...
    def model_states(self) -> dict[str, str]: ...
    def stub_processes(self) -> dict[int, str]: ...
    def hang_report(self, models: set[str] | None = None) -> str: ...


class Supervisor:
    """Watches `server`'s process from `begin` until the server is stopped or given up (`done`),
    and the stubs of each start of it from that start's `launched`, which the server calls as soon
    as the process is there: a stub that dies while other models still load is seen, and handled
    once the server is ready (a watch taken once it was ready never knew that stub)."""

    def __init__(self, server: Supervised, period: float = 0.5, retire_s: float = RETIRE_S) -> None:
        self.server, self.period, self.retire_s = server, period, retire_s
        self.done = threading.Event()
        self._changed = threading.Condition()
        self._restarts: collections.deque[float] = collections.deque()
        self._kill_reason: str | None = None
        self._watch: StepWatch | None = None
        self._serving: subprocess.Popen | None = None  # the process whose start has ended (ready)

    def launched(self, process: subprocess.Popen) -> None:
        """A start of the server: its stubs are watched from now on, as they start; the watch of
        the start before ends."""
        self.close()
        self._watch = StepWatch(process.pid, set(), lambda instance, pid: self._stub_died(process, instance, pid),
                                ready=lambda model: True, period=self.period, exits=self.server.stub_exits)

    def begin(self) -> None:
        """The server is ready: from now on its process is waited for, and started again when it
        exits. Its stubs are known before this returns (a scan may not have come since the last
        of them started)."""
        self._ready()
        threading.Thread(target=self._run, args=(self.server.process,), name="triton-supervisor", daemon=True).start()

    def _ready(self) -> None:
        """The server's current start has ended: deaths seen meanwhile are handled from now on
        (`_serves`), and its stubs are known at once."""
        self._serving = self.server.process
        self._watch.learn()

    def close(self) -> None:
        """End the watch of the stubs (a start that failed: `begin` never came)."""
        if self._watch is not None:
            self._watch.close()

    def _run(self, process: subprocess.Popen) -> None:
        try:
            while True:
                try:
                    code = process.wait()
                finally:
                    self.close()
                if self.server.stopping or not self._restart(code):
                    return
                process = self.server.process
        finally:
            with self._changed:
                self.done.set()
                self._changed.notify_all()

    def _restart(self, code: int) -> bool:
        """Start the server again after it exited with `code`, unless it was restarted too often
        (False)."""
        reason, self._kill_reason = self._kill_reason or f"tritonserver exited by itself with code {code}", None
        while True:
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
                self._restarts.popleft()
            if len(self._restarts) >= MAX_RESTARTS:
                self.server.event(f"{reason}; {MAX_RESTARTS} restarts within {RESTART_WINDOW_S:.0f} s already: "
                                  f"giving up")
                return False
            self._restarts.append(now)
            self.server.event(f"{reason}: restarting it")
            try:
                self.server.relaunch()
                break
            except (Aborted, NotReady) as error:  # a start that crashed or wedged: one more, within the budget
                self.server.event(f"the restart failed: {error}")
                reason = "the restart failed"
            except ServerError as error:
                self.server.event(f"restarting tritonserver failed: {error}")
                return False
        self._ready()
        with self._changed:
            self._changed.notify_all()
        self.server.event("tritonserver restarted")
        return True

    def replaced(self, process: subprocess.Popen) -> bool:
        """After `process` exited: wait until a restart has replaced it (True) or none will (False)."""
        with self._changed:
            self._changed.wait_for(lambda: self.server.process is not process or self.done.is_set())
            return self.server.process is not process

    def _stub_died(self, process: subprocess.Popen, instance: str, pid: int) -> None:
        # the server went, or is being killed (a dead ensemble): its stubs go with it
        if not self._serves(process):
            return
        model = model_of(instance)
        if model in RESTART_ON_DEATH:
            self._kill(process, f"model instance {instance} died (stub pid {pid}); Triton holds its requests "
                                f"for good, so tritonserver was killed")
            return
        if self.server.model_states().get(model) not in ("READY", None):  # an operator unloads or reloads it
            return
        self.server.event(f"model instance {instance} died (stub pid {pid}); requests routed to it fail "
                          f"until the model is reloaded: reloading {model!r}")
        limit = self.server.start_timeout
        old = {p: start_ticks(p) for p, i in self.server.stub_processes().items() if model_of(i) == model}
        try:
            self._reload(model, limit)
            self.server.event(f"model {model!r} reloaded")
        except InferenceServerException as error:
            if error.status() == "StatusCode.UNAVAILABLE":  # the server dropped the call: it may be going
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=EXIT_SEEN_S)
            if process.poll() is not None or self.server.stopping:  # it went meanwhile: its restart follows
                return
            if error.status() == "StatusCode.DEADLINE_EXCEEDED":
                # python_backend r24.10 may never start a new instance after a stub was killed (the
                # new stubs wait for their initialize message): the server is wedged for the model
                self._kill(process, f"reloading {model!r} did not end within {limit:.0f} s (the time a start may "
                                    f"take), so tritonserver was killed; {self.server.hang_report({model})}")
                return
            # a model that is not loaded again would fail every request routed to it for good
            self._kill(process, f"reloading {model!r} failed ({error}), so tritonserver was killed")
            return
        threading.Thread(target=self._retire, args=(process, model, old, min(limit, self.retire_s)),
                         name="triton-retire", daemon=True).start()

    def _serves(self, process: subprocess.Popen) -> bool:
        """Wait until the start of `process` has ended (a death seen while the server starts is
        handled once it is ready); False if it went, or is being stopped or killed, first."""
        deadline = time.monotonic() + self.server.start_timeout
        while True:
            if process.poll() is not None or self.server.stopping or self._kill_reason is not None:
                return False
            if self._serving is process:
                return True
            if time.monotonic() > deadline:  # its start's own limit kills it
                return False
            time.sleep(self.period)

    def _retire(self, process: subprocess.Popen, model: str, old: dict[int, int], limit: float) -> None:
        """Wait until the old instances of `model` (pid -> start, in clock ticks) have ended, and
        say so; kill the server if some are still there after `limit` seconds (the module's
        docstring)."""
        deadline = time.monotonic() + limit
        while True:
            if process.poll() is not None or self.server.stopping or self._kill_reason is not None:
                return
            lingering = sorted(p for p in self.server.stub_processes() if p in old and start_ticks(p) == old[p])
            if not lingering:
                self.server.event(f"the old instances of {model!r} ended")
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(self.period)
        self._kill(process, f"the old instances of {model!r} (stub pids {lingering}) were still there {limit:.0f} s "
                            f"after its reload: Triton unloads a model version once all its requests have ended, "
                            f"and those the dead stub held never do; so tritonserver was killed")

    def _reload(self, model: str, limit: float) -> None:
        """Unload `model`, then load it again: Triton treats a load of an unchanged model as a
        no-op that keeps the dead instance (touching its files is not enough). Requests to it fail
        for the few seconds in between. Over gRPC, where Triton runs a load on a thread of its own:
        over HTTP it holds one of the HTTP server's threads until it ends, and every client
        connection served by that thread waited as long (an HTTP generate_stream request took 6 s
        in a preprocess reload)."""
        with grpcclient.InferenceServerClient(self.server.grpc_url) as client:
            key = admin.headers(self.server.admin_key, grpc=True)
            client.unload_model(model, headers=key, client_timeout=limit)
            client.load_model(model, headers=key, client_timeout=limit)

    def _kill(self, process: subprocess.Popen, reason: str) -> None:
        """Kill the server and its stubs; `_run` restarts it, for `reason` (the first one given)."""
        self._kill_reason = self._kill_reason or reason
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
