"""`triton_vlm.server.stubs.StepWatch` with stand-in processes: a "server" that starts "stubs" (Python run
as `triton_python_backend_stub` on a REPOSITORY/MODEL/1/model.py that sleeps, with the instance name
where Triton puts it) when told to."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from triton_vlm.server.stubs import StepWatch, exit_marker, model_of, start_ticks, stub_processes

PERIOD = 0.02
SERVER = """
import subprocess, sys
stubs = {}
for line in sys.stdin:  # "MODEL_FILE INSTANCE_NAME" per line: start a stub of that instance
    model_file, instance = line.split()
    stub = subprocess.Popen([sys.argv[1], model_file, instance, "DEFAULT"])
    print(stub.pid, flush=True)
"""


class StandIn:
    def __init__(self, tmp_path: Path) -> None:
        self.repository = tmp_path / "repository"
        self.exits = f"{tmp_path}/exited_"  # (a real server's: under its shared-memory prefix)
        program = tmp_path / "triton_python_backend_stub"
        program.symlink_to(sys.executable)
        self.program, self.started = program, []
        self.process = subprocess.Popen([sys.executable, "-c", SERVER, str(program)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.pid = self.process.pid

    def start(self, instance: str, model: str | None = None) -> int:
        """A new stub of `model` (the instance's), once it runs as one (and a watch's period later)."""
        model_file = self.repository / (model or model_of(instance)) / "1" / "model.py"
        model_file.parent.mkdir(parents=True, exist_ok=True)
        model_file.write_text("import time; time.sleep(600)\n")
        self.process.stdin.write(f"{model_file} {instance}\n")
        self.process.stdin.flush()
        pid = int(self.process.stdout.readline())
        self.started.append(pid)
        wait_until(lambda: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == bytes(self.program))
        time.sleep(25 * PERIOD)  # (a watch looks every PERIOD: margin for a busy CPU)
        return pid

    def end(self, pid: int) -> None:
        """Stub `pid` ends by itself, as at its model's unload: it leaves its marker as it exits."""
        exit_marker(self.exits, pid, start_ticks(pid)).touch()
        os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        for pid in self.started:
            with contextlib.suppress(ProcessLookupError):
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
    pids = {name: server.start(name) for name in ("ensemble_0_0", "llm_0_0", "preprocess_0_0")}
    time.sleep(1.5)  # one load's instances, started seconds apart (a busy CPU)
    pids["preprocess_0_1"] = server.start("preprocess_0_1")
    assert stub_processes(server.pid) == {pid: name for name, pid in pids.items()}
    deaths: list[tuple[str, int]] = []
    ready = threading.Event()
    watch = StepWatch(server.pid, {"ensemble"}, lambda instance, pid: deaths.append((instance, pid)),
                      ready=lambda model: ready.is_set(), period=PERIOD, exits=server.exits)
    try:
        os.kill(pids["ensemble_0_0"], signal.SIGKILL)  # ignored
        os.kill(pids["preprocess_0_0"], signal.SIGKILL)
        wait_until(lambda: deaths)
        assert deaths == [("preprocess_0_0", pids["preprocess_0_0"])]
        assert watch.down("preprocess") and not watch.down("llm")
        server.end(pids["preprocess_0_1"])  # the reload's unload ends the model's other stub: no death
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


def test_the_stub_that_reads_a_models_config_is_not_an_instance(server):
    """Triton runs one stub per model, named after it, to read its config and ends it before the
    instances start: neither a stub of the server's instances, nor a death when it ends."""
    config = server.start("vision_encoder_batch", model="vision_encoder_batch")
    instance = server.start("vision_encoder_batch_0_0")
    assert stub_processes(server.pid) == {instance: "vision_encoder_batch_0_0"}
    deaths: list[tuple[str, int]] = []
    watch = StepWatch(server.pid, set(), lambda instance, pid: deaths.append((instance, pid)),
                      ready=lambda model: True, period=PERIOD, exits=server.exits)
    try:
        os.kill(config, signal.SIGKILL)
        time.sleep(5 * PERIOD)
        assert deaths == [] and not watch.down("vision_encoder_batch")
    finally:
        watch.close()


def test_an_operators_load_is_not_retired_by_the_old_stubs_exit(server):
    """Unload then load: the old stub may exit after the new one started (and is ready). It ends
    by itself, no death: the model is not down."""
    deaths: list[tuple[str, int]] = []
    old = server.start("llm_0_0")
    watch = StepWatch(server.pid, set(), lambda instance, pid: deaths.append((instance, pid)),
                      ready=lambda model: True, period=PERIOD, exits=server.exits)
    try:
        new = server.start("llm_0_0")
        server.end(old)
        time.sleep(5 * PERIOD)
        assert deaths == [] and not watch.down("llm")
        os.kill(new, signal.SIGKILL)  # a later death of the new one is seen
        wait_until(lambda: deaths)
        assert deaths == [("llm_0_0", new)] and watch.down("llm")
    finally:
        watch.close()
