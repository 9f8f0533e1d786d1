"""`triton_vlm.server.supervisor.Supervisor`'s restarts, on a stand-in server whose "tritonserver" is a
process that exits at once (a crash loop): each exit is restarted until MAX_RESTARTS within
RESTART_WINDOW_S, then the supervisor gives up and `replaced` tells the waiter so; a stop ends
it without a restart."""
from __future__ import annotations

import subprocess
import sys
import threading

from triton_vlm.server.supervisor import MAX_RESTARTS, Supervisor


class StandInServer:
    """What the supervisor uses of a `TritonServer`; its process exits after `lifetime` seconds."""

    def __init__(self, lifetime: float) -> None:
        self.lifetime = lifetime
        self.events: list[str] = []
        self.launches = 0
        self.stub_exits = ""
        self._stopping = threading.Event()
        self.process = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        self.launches += 1
        return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({self.lifetime})"])

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def event(self, message: str) -> None:
        self.events.append(message)

    def relaunch(self) -> None:
        self.process = self._spawn()


def test_a_server_exiting_by_itself_is_restarted_until_the_budget_is_spent():
    server = StandInServer(lifetime=0.0)
    first = server.process
    supervisor = Supervisor(server, period=0.05)
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
    supervisor = Supervisor(server, period=0.05)
    first = server.process
    server._stopping.set()
    first.terminate()
    assert supervisor.done.wait(30)
    assert server.launches == 1 and server.events == []
    assert not supervisor.replaced(first)
