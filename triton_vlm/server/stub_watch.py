"""A Python-backend stub must not outlive its tritonserver: one small watcher process per stub.

When tritonserver dies without unloading its models (a crash, SIGKILL), each stub notices by
itself, but its way out waits for a lock that a thread blocked in a call to the dead server
holds forever: a metric update, a response `send`, a BLS request or `is_cancelled()`. Those calls
also keep the GIL while they wait, so no thread of the stub can run Python any more; the llm
(whose metrics thread calls the server every 100 ms) and the ensemble stayed alive that way.

So a separate process acts: `start()`, called as a stub imports `triton_vlm.serving.backend.pb` (so
also in the stub Triton starts first to read a model's config, which calls no `initialize`, and which
stayed alive that way after its server aborted), runs `python -m
triton_vlm.server.stub_watch STUB_PID SERVER_PID`. The watcher holds pidfds of the stub (its parent)
and of the server and sleeps in `poll` on both: the server's exit gets the stub SIGKILL, the
stub's own exit ends the watcher. A pidfd names one process for good, so a pid reused later is
never signalled. A stub whose parent is no tritonserver when it starts (the server was killed while
it loaded the model: the stub's parent is init then) is killed at once.
"""
from __future__ import annotations

import atexit
import logging
import os
import select
import signal
import subprocess
import sys
import threading

_started = threading.Lock()   # held for good once this process has its watcher
_watcher: list[subprocess.Popen] = []


def start() -> None:
    """Start the watcher of this stub process (once; later calls do nothing)."""
    if not _started.acquire(blocking=False):
        return
    try:
        _watcher.append(subprocess.Popen(
            [sys.executable, "-m", "triton_vlm.server.stub_watch", str(os.getpid()), str(os.getppid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
    except OSError:  # the model serves all the same
        logging.getLogger("triton_vlm").exception("no watcher for this stub: it may outlive a crashed tritonserver")


def exit_without_teardown() -> None:
    """End this stub, once its interpreter starts to finalize, without tearing the interpreter down.

    A stub finalizes its interpreter after it has answered the server's finalize message and
    released the shared memory, and the server waits for its exit: tearing down every module
    (torch, transformers, ONNX Runtime) took about a second a stub, at every model unload and
    server stop, one instance after another. Registered first, this runs after every other exit
    handler (they run last registered first). It marks the stub's end as one of its own first."""
    atexit.register(_exit_now)


def _exit_now() -> None:
    from triton_vlm.server.stubs import note_exit

    note_exit()  # an end of its own, not a death (`triton_vlm.server.stubs.StepWatch`)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _parent_of(pid: int) -> int:
    from triton_vlm.server.stubs import proc_stat

    return int(proc_stat(pid)[1])


def _is_tritonserver(pid: int) -> bool:
    """Whether `pid` runs a program named tritonserver (its name as executed, as `ps` shows it)."""
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip() == "tritonserver"
    except OSError:
        return False


def watch(stub_pid: int, server_pid: int) -> None:
    """Wait until the stub or the server exits; kill the stub if the server went first."""
    try:
        stub = os.pidfd_open(stub_pid)
    except ProcessLookupError:
        return  # the stub is gone already
    if os.getppid() != stub_pid:
        return  # the stub is gone already (taken before this check, the pidfd named it if it was not)
    try:
        server = os.pidfd_open(server_pid)
        # so that `server` names the stub's parent, and a tritonserver
        server_alive = _parent_of(stub_pid) == server_pid and _is_tritonserver(server_pid)
    except OSError:
        server_alive = False
    if server_alive:
        poller = select.poll()
        poller.register(stub, select.POLLIN)
        poller.register(server, select.POLLIN)
        if stub in {fd for fd, _ in poller.poll()}:
            return
    try:
        signal.pidfd_send_signal(stub, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it exited meanwhile


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
