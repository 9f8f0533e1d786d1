"""`triton_vlm.stubs.StepWatch` with stand-in processes: a "server" that starts "stubs" (Python run
as `triton_python_backend_stub`, with the instance name where Triton puts it) when told to."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from triton_vlm.stubs import StepWatch, stub_processes

PERIOD = 0.02
SERVER = """
import subprocess, sys
stubs = {}
for line in sys.stdin:  # one instance name per line: start a stub of that name
    stub = subprocess.Popen([sys.argv[1], "-c", "import time; time.sleep(600)", line.strip(), "DEFAULT"])
    print(stub.pid, flush=True)
"""


class StandIn:
    def __init__(self, tmp_path: Path) -> None:
        program = tmp_path / "triton_python_backend_stub"
        program.symlink_to(sys.executable)
        self.process = subprocess.Popen([sys.executable, "-c", SERVER, str(program)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.pid = self.process.pid

    def start(self, instance: str) -> int:
        """A new stub, once it runs as one (and a watch's period later)."""
        self.process.stdin.write(instance + "\n")
        self.process.stdin.flush()
        pid = int(self.process.stdout.readline())
        wait_until(lambda: pid in stub_processes(self.pid))
        time.sleep(2 * PERIOD)
        return pid

    def close(self) -> None:
        for pid in stub_processes(self.pid):
            os.kill(pid, signal.SIGKILL)
        self.process.kill()
        self.process.wait()


@pytest.fixture
def server(tmp_path):
    stand_in = StandIn(tmp_path)
    yield stand_in
    stand_in.close()


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_death_is_reported_once_per_model_and_the_model_is_down_until_a_new_stub_is_ready(server):
    pids = {name: server.start(name) for name in ("ensemble_0_0", "llm_0_0", "preprocess_0_0", "preprocess_0_1")}
    assert stub_processes(server.pid) == {pid: name for name, pid in pids.items()}
    deaths: list[tuple[str, int]] = []
    ready = threading.Event()
    watch = StepWatch(server.pid, {"ensemble"}, lambda instance, pid: deaths.append((instance, pid)),
                      ready=lambda model: ready.is_set(), period=PERIOD)
    try:
        os.kill(pids["ensemble_0_0"], signal.SIGKILL)  # ignored
        os.kill(pids["preprocess_0_0"], signal.SIGKILL)
        wait_until(lambda: deaths)
        assert deaths == [("preprocess_0_0", pids["preprocess_0_0"])]
        assert watch.down("preprocess") and not watch.down("llm")
        os.kill(pids["preprocess_0_1"], signal.SIGKILL)  # the reload retires the model's other stub
        server.start("preprocess_0_0")
        assert watch.down("preprocess")  # a new stub, not yet ready
        ready.set()
        assert not watch.down("preprocess")  # looked at again when asked
        llm = server.start("llm_0_1")  # a stub started later is watched too
        os.kill(llm, signal.SIGKILL)
        wait_until(lambda: len(deaths) == 2)
        time.sleep(5 * PERIOD)
        assert deaths[1] == ("llm_0_1", llm) and len(deaths) == 2
    finally:
        watch.close()
