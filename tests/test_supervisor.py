"""`triton_vlm.server.supervisor.Supervisor`'s restarts, on a stand-in server whose "tritonserver" is a
process that exits at once (a crash loop): each exit is restarted until MAX_RESTARTS within
RESTART_WINDOW_S, then the supervisor gives up and `replaced` tells the waiter so; a stop ends
it without a restart. A reload that leaves the model's old instances running gets the server
restarted, without holding up the supervisor's handling of other deaths meanwhile. A stub that
dies while the server starts is seen, and its model reloaded once the server is ready."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from triton_vlm.server.stubs import exit_marker, start_ticks, stub_processes
from triton_vlm.server.supervisor import MAX_RESTARTS, Supervisor


class StandInServer:
    """What the supervisor uses of a `TritonServer`, started as `TritonServer.start` does (`start`);
    its process exits after `lifetime` seconds."""
    start_timeout = 3.0

    def __init__(self, lifetime: float) -> None:
        self.lifetime = lifetime
        self.events: list[str] = []
        self.launches = 0
        self.stub_exits = ""
        self._stopping = threading.Event()
        self.supervisor: Supervisor | None = None

    def start(self, supervisor: type[Supervisor] = Supervisor, period: float = 0.05) -> Supervisor:
        self.supervisor = supervisor(self, period=period)
        self.relaunch()
        self.supervisor.begin()
        return self.supervisor

    def command(self) -> list[str]:
        return [sys.executable, "-c", f"import time; time.sleep({self.lifetime})"]

    def relaunch(self) -> None:
        self.launches += 1
        # the leader of its own process group, as tritonserver is (the supervisor kills the group)
        self.process = subprocess.Popen(self.command(), start_new_session=True)
        self.supervisor.launched(self.process)
        while not self.is_ready():  # as TritonServer's start returns once the server is ready
            time.sleep(0.05)

    def is_ready(self) -> bool:
        return True

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def event(self, message: str) -> None:
        self.events.append(message)


def test_a_server_exiting_by_itself_is_restarted_until_the_budget_is_spent():
    server = StandInServer(lifetime=0.0)
    supervisor = server.start()
    first = server.process
    assert supervisor.replaced(first)  # a waiter on the first process goes on to the next
    assert supervisor.done.wait(60)
    assert server.launches == 1 + MAX_RESTARTS
    restarting = [e for e in server.events if e.endswith(": restarting it")]
    assert len(restarting) == MAX_RESTARTS
    assert all(e.startswith("tritonserver exited by itself with code 0") for e in restarting)
    assert server.events.count("tritonserver restarted") == MAX_RESTARTS
    assert server.events[-1].endswith(f"{MAX_RESTARTS} restarts within 300 s already: giving up")
    assert not supervisor.replaced(server.process)  # the waiter learns that no restart comes


def test_a_stopped_server_is_not_restarted():
    server = StandInServer(lifetime=60.0)
    supervisor = server.start()
    first = server.process
    server._stopping.set()
    first.terminate()
    assert supervisor.done.wait(30)
    assert server.launches == 1 and server.events == []
    assert not supervisor.replaced(first)


class StandInWithStubs(StandInServer):
    """A stand-in whose "stubs" of `vision_encoder` are sleeping processes."""

    def __init__(self) -> None:
        super().__init__(lifetime=60.0)
        self.stubs = {subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]): f"vision_encoder_0_{i}"
                      for i in range(2)}

    def stub_processes(self) -> dict[int, str]:
        return {stub.pid: name for stub, name in self.stubs.items() if stub.poll() is None}

    def model_states(self) -> dict[str, str]:
        return {"vision_encoder": "READY"}

    def end(self) -> None:
        self._stopping.set()
        self.process.kill()
        for stub in self.stubs:
            stub.kill()
            stub.wait()


class Reloading(Supervisor):
    """Its reload of a model ends the model's old stubs where `retires` (as Triton's unload does),
    or leaves them running."""
    retires = True

    def _reload(self, model: str, limit: float) -> None:
        self.server.event(f"reload {model}")
        for stub in self.server.stubs if self.retires else ():
            stub.kill()


class Starting(StandInServer):
    """A stand-in "tritonserver" that starts two stubs of `preprocess` as Triton does (children
    named `triton_python_backend_stub`, the instance name third from the end), the first of which
    ends after `first_s` seconds, and that is ready `ready_s` seconds after its start."""

    def __init__(self, folder: Path, first_s: float = 0.3, ready_s: float = 1.5) -> None:
        super().__init__(lifetime=60.0)
        self.ready_s = ready_s
        (folder / "exited").mkdir()
        self.stub_exits = f"{folder / 'exited'}/"  # where the stubs an unload ends are marked
        (folder / "preprocess" / "1").mkdir(parents=True)
        (model := folder / "preprocess" / "1" / "model.py").write_text("import sys, time; time.sleep(float(sys.argv[1]))")
        (stub := folder / "triton_python_backend_stub").symlink_to(sys.executable)
        self.script = (f"import subprocess, time\n"
                       f"for seconds, instance in (({first_s}, 'preprocess_0_0'), (60, 'preprocess_0_1')):\n"
                       f"    subprocess.Popen([{str(stub)!r}, {str(model)!r}, str(seconds), instance, 'DEFAULT'])\n"
                       f"time.sleep(60)")

    def command(self) -> list[str]:
        self.started = time.monotonic()
        return [sys.executable, "-c", self.script]

    def is_ready(self) -> bool:
        return time.monotonic() - self.started > self.ready_s

    def stub_processes(self) -> dict[int, str]:
        return stub_processes(self.process.pid)

    def model_states(self) -> dict[str, str]:
        return {"preprocess": "READY"}

    def end(self) -> None:
        self._stopping.set()
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


class ReloadingStubs(Supervisor):
    """Its reload of a model ends the model's stubs, marked as ending by themselves (as Triton's
    unload ends them, and they mark it)."""

    def _reload(self, model: str, limit: float) -> None:
        self.server.event(f"reload {model}, ready {self.server.is_ready()}")
        for pid in self.server.stub_processes():
            exit_marker(self.server.stub_exits, pid, start_ticks(pid)).touch()
            os.kill(pid, signal.SIGKILL)


def reload_after_death(retires: bool) -> tuple[StandInWithStubs, Reloading, float]:
    server = StandInWithStubs()
    supervisor = server.start(Reloading)
    supervisor.retires = retires
    started = time.monotonic()
    supervisor._stub_died(server.process, "vision_encoder_0_2", 1)  # as its watch calls it
    return server, supervisor, time.monotonic() - started


def wait_for_event(server: StandInWithStubs, event: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while event not in server.events:
        assert time.monotonic() < deadline, server.events
        time.sleep(0.05)


def test_a_reload_whose_old_instances_end_keeps_the_server():
    server, supervisor, took = reload_after_death(retires=True)
    try:
        wait_for_event(server, "the old instances of 'vision_encoder' ended")
        assert server.events == ["model instance vision_encoder_0_2 died (stub pid 1); requests routed to it fail "
                                 "until the model is reloaded: reloading 'vision_encoder'",
                                 "reload vision_encoder", "model 'vision_encoder' reloaded",
                                 "the old instances of 'vision_encoder' ended"]
        assert took < server.start_timeout and server.process.poll() is None and server.launches == 1
    finally:
        server.end()
        assert supervisor.done.wait(30)


def test_old_instances_still_running_after_a_reload_get_the_server_restarted():
    server, supervisor, took = reload_after_death(retires=False)
    try:
        assert took < 1.0  # the wait for the old instances runs on a thread of its own
        wait_for_event(server, "tritonserver restarted")
        pids = sorted(stub.pid for stub in server.stubs)
        assert server.events[2:] == [
            "model 'vision_encoder' reloaded",
            f"the old instances of 'vision_encoder' (stub pids {pids}) were still there 3 s after its reload: "
            f"Triton unloads a model version once all its requests have ended, and those the dead stub held "
            f"never do; so tritonserver was killed: restarting it",
            "tritonserver restarted"], server.events
        assert server.launches == 2
    finally:
        server.end()
        assert supervisor.done.wait(30)


def test_a_stub_that_dies_while_the_server_starts_is_reloaded_once_it_is_ready(tmp_path):
    """Its watch begins at the start, not once the server is ready: Triton keeps a model whose stub
    died READY, and every request routed to that instance would fail."""
    server = Starting(tmp_path)
    supervisor = server.start(ReloadingStubs)
    try:
        wait_for_event(server, "the old instances of 'preprocess' ended")
        died = server.events[0]
        assert died.startswith("model instance preprocess_0_0 died (stub pid "), server.events
        assert server.events[1:] == ["reload preprocess, ready True", "model 'preprocess' reloaded",
                                     "the old instances of 'preprocess' ended"], server.events
    finally:
        server.end()
        assert supervisor.done.wait(30)


def test_a_stub_that_dies_right_after_the_start_is_seen_before_the_next_scan_knew_it(tmp_path):
    """The stubs alive when the server is ready are known before its start returns: a scan may
    not have come since the last of them started (here scans are 3 s apart)."""
    server = Starting(tmp_path, first_s=60.0, ready_s=0.3)
    supervisor = server.start(ReloadingStubs, period=3.0)
    try:
        stub = next(pid for pid, name in server.stub_processes().items() if name == "preprocess_0_0")
        os.kill(stub, signal.SIGKILL)
        wait_for_event(server, "model 'preprocess' reloaded", timeout=20)
        assert server.events[0].startswith(f"model instance preprocess_0_0 died (stub pid {stub})"), server.events
    finally:
        server.end()
        assert supervisor.done.wait(30)
