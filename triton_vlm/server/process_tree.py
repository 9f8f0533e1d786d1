"""What a deployment's processes hold, sampled from /proc: threads, resident memory and open
descriptors of a process and each of its descendants, by role (`serve`, `tritonserver`, each
model's stubs, their watchers, the llm's tensor-parallel ranks), and the Python backend's
shared-memory regions in /dev/shm.

Roles, not pids, are what a long run compares: a restarted stub or server is a new pid in the
same role. `bench/soak.py` samples them every few seconds; the leak test samples its own process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from triton_vlm.server.stubs import model_of, proc_stat

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "triton_python_backend_shm_region"


@dataclass(frozen=True)
class Usage:
    """One process's (or a role's summed) threads, resident memory in bytes and open descriptors.

    `rss` counts every page a process maps, shared or not; `pss` counts a page shared by N
    processes as 1/N in each, so a sum of `pss` is what the processes hold in memory. Summed `rss`
    counts the libraries every stub maps once a stub, a Python backend region once for the server
    and once for its stub, and, in the server, a region again for each mapping of it python_backend
    keeps as the region grows (it never unmaps the old ones)."""
    threads: int = 0
    rss: int = 0
    fds: int = 0
    pss: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.threads + other.threads, self.rss + other.rss, self.fds + other.fds, self.pss + other.pss)


def proc_bytes(text: str, field: str) -> int:
    """The value of `field` (in kB) in a /proc status or smaps_rollup text, in bytes (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def usage(pid: int) -> Usage | None:
    """`pid`'s usage now (None once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    threads = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:"))
    return Usage(threads, proc_bytes(status, "VmRSS"), fds, proc_bytes(rollup, "Pss"))


def children() -> dict[int, list[int]]:
    """ppid -> its child pids, for every process now."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                tree.setdefault(int(proc_stat(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return tree


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    tree, found, todo = children(), [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(tree.get(found[-1], []))
    return found


def role(pid: int) -> str:
    """What `pid` is in a deployment: `tritonserver`, `stub <model>` (a Python-backend stub; `stub
    <model> (config)` the one that reads its config first), `watch` (`triton_vlm.server.stub_watch`),
    `reaper` (`triton_vlm.server.reaper`), `rank` (a spawned multiprocessing process: the llm's
    tensor-parallel ranks and their resource tracker), or its command name."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    if argv[0].endswith(b"triton_python_backend_stub") and len(argv) >= 4:
        instance, model_dir = argv[-3].decode(), Path(argv[1].decode()).parts[-3:-2]
        if model_dir == (instance,):  # the stub that reads a model's config before its instances start
            return f"stub {instance} (config)"
        return f"stub {model_of(instance)}"
    if b"triton_vlm.server.stub_watch" in argv:
        return "watch"
    if b"triton_vlm.server.reaper" in argv:
        return "reaper"
    if any(arg.startswith(b"from multiprocessing.") for arg in argv):
        return "rank"
    return comm


def sample(root: int, root_role: str = "serve") -> dict[str, Usage]:
    """role -> the summed usage of its processes, over `root` (named `root_role`) and its
    descendants now."""
    roles: dict[str, Usage] = {}
    for pid in descendants(root):
        now = usage(pid)
        if now is not None:
            name = root_role if pid == root else role(pid)
            roles[name] = roles.get(name, Usage()) + now
    return roles


def shm_regions() -> dict[str, int]:
    """The Python backend's shared-memory regions in /dev/shm: name -> bytes."""
    found = {}
    for path in SHM_DIR.glob(f"{SHM_PREFIX}*"):
        try:
            found[path.name] = path.stat().st_size
        except OSError:  # (removed meanwhile)
            continue
    return found
