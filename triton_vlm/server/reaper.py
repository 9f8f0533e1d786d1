"""A tritonserver must not outlive the process that started it, nor leave anything behind it: one
small reaper process per server start (`python -m triton_vlm.server.reaper`).

`TritonServer` starts it right after each tritonserver, in a session of its own (a kill of the
owner's process group does not reach it), handing it pidfds of the owner and of the server: a
pidfd names one process for good, so a pid reused later is never signalled, and the owner's
becomes readable when its last thread ends, whichever thread started the server (the kernel's
parent-death signal fires when the starting *thread* ends, so a server started from a supervisor
thread had none). The reaper sleeps in `poll` on both and:
- when the owner ends first (SIGKILL, a killed test run or CI job), asks the server to stop
  (SIGTERM: it drains and unloads its models) and kills what is left after `grace` seconds;
- when the server ends, however it ended, kills what is left of its process group (its
  Python-backend stubs, their watchers, the llm's tensor-parallel ranks) and, once they have
  gone, removes the Python backend's shared-memory regions of this server start that no process
  maps any more: a server that exits cleanly removes its own; one that is killed leaves about
  1 MB per stub in /dev/shm for good.
Which regions were the server's is told by their names: each start is given a prefix of its own
(`TritonServer`: python_backend's `shm-region-prefix-name`). Telling them by age and by no process
mapping them at that moment, as this did first, removed the regions of a server starting beside
(created, not yet mapped): its stubs then opened fresh, empty ones, and that server aborted with
boost's `lock_exception` or never saw its models load.
"""
from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from triton_vlm.server.process_tree import SHM_DIR, SHM_PREFIX
from triton_vlm.server.stubs import proc_stat

_PROJECT_ROOT = Path(__file__).resolve().parents[2]
_GONE_S = 10.0  # how long the killed group may take to be gone before its regions are looked at


def group_members(pgid: int, live: bool = False) -> list[int]:
    """The processes of process group `pgid` now (`live`: not those that have exited and wait to
    be reaped)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = proc_stat(int(entry.name))
                if int(stat[2]) == pgid and not (live and stat[0] == "Z"):
                    members.append(int(entry.name))
    return members


def mapped_regions(pids: list[int] | None = None) -> set[str]:
    """The Python backend's shared-memory regions (names in /dev/shm) that `pids` (default: every
    process) map."""
    found: set[str] = set()
    marker = f"{SHM_DIR}/{SHM_PREFIX}"
    for pid in pids if pids is not None else [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                at = line.find(marker)
                if at >= 0:
                    found.add(line[at + len(str(SHM_DIR)) + 1:].split()[0])
    return found


def orphan_regions(prefix: str) -> list[Path]:
    """The regions in /dev/shm named `prefix`... (one server start's) that no process maps."""
    if not prefix.startswith(SHM_PREFIX):
        raise ValueError(f"{prefix!r}: not a Python backend region prefix")
    ours = list(SHM_DIR.glob(f"{prefix}*"))
    mapped = mapped_regions() if ours else set()
    return [path for path in ours if path.name not in mapped]


def reap(owner: int, server: int, server_pid: int, grace: float, shm_prefix: str) -> None:
    """Watch the pidfds `owner` and `server` (of `server_pid`, the leader of its process group,
    whose stubs' regions are named `shm_prefix`..., none where empty) until the server has gone,
    then clean up after it (module docstring)."""
    poller = select.poll()
    poller.register(owner, select.POLLIN)
    poller.register(server, select.POLLIN)
    ready = {fd for fd, _ in poller.poll()}
    if server not in ready:  # the owner went first
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(server, signal.SIGTERM)
        select.select([server], [], [], grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server_pid, signal.SIGKILL)
    deadline = time.monotonic() + _GONE_S
    while group_members(server_pid, live=True) and time.monotonic() < deadline:
        time.sleep(0.05)
    for path in orphan_regions(shm_prefix) if shm_prefix else ():
        if path.is_dir():  # the folder of its stubs' exit markers (`triton_vlm.server.stubs`)
            shutil.rmtree(path, ignore_errors=True)
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def start(process: subprocess.Popen, grace: float, shm_prefix: str = "") -> subprocess.Popen:
    """The reaper of `process` (started in a session of its own: it leads its process group; its
    Python backend's regions named `shm_prefix`...), just started: in a session of its own too,
    with pidfds of this process and of `process` (taken before anything could wait for `process`,
    so that they name it even if it has exited)."""
    owner, child = os.pidfd_open(os.getpid()), os.pidfd_open(process.pid)
    try:
        return subprocess.Popen([sys.executable, "-m", "triton_vlm.server.reaper", str(owner), str(child),
                                 str(process.pid), str(grace), shm_prefix], pass_fds=(owner, child),
                                cwd=_PROJECT_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                start_new_session=True)
    finally:
        os.close(owner)
        os.close(child)


if __name__ == "__main__":
    # OWNER_PIDFD SERVER_PIDFD SERVER_PID GRACE_S SHM_PREFIX: the pidfds are inherited (`start`)
    reap(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
