"""Issue #36: serving leaves nothing behind it.

Requests (answered, cancelled, refused) leave no thread in the stubs or in the client, and
supervised servers started and stopped one after another, with a stub or tritonserver itself
killed in some, leave the process that ran them with the threads and descriptors it had, no
child process, no process of theirs and no shared-memory region in /dev/shm.
"""
from __future__ import annotations

import gc
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.metrics import wait_for
from triton_vlm.clients.client import RequestError, generate, grpc_inputs, request_values
from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL
from triton_vlm.media import samples
from triton_vlm.server.process_tree import sample
from triton_vlm.server.reaper import group_members, mapped_regions
from triton_vlm.server.stubs import proc_stat

SERVERS = 20  # the number of supervised servers in one process
PROMPT = f"<|im_start|>user\n{QWEN2_5_VL.image_placeholder}What is it?<|im_end|>\n<|im_start|>assistant\n"
IMAGE = samples.image_bytes(64, 48)


class _Cancel(Exception):
    """Raised from a stream's text callback: the client walks away mid-answer."""


def _cancel(text: str) -> None:
    raise _Cancel(text)


def _stub_threads(server_pid: int) -> dict[str, int]:
    """Each model's stubs' threads (the server's own come and go with its gRPC and HTTP pools)."""
    return {role: use.threads for role, use in sample(server_pid, "tritonserver").items() if role.startswith("stub")}


def _own() -> tuple[int, int]:
    """This process's threads (the kernel's count: Python's and native ones) and descriptors."""
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _descriptors() -> list[str]:
    """What this process's descriptors are open on (said when their count does not come back)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return sorted(targets)


def _above(now: tuple[int, int], before: tuple[int, int]) -> bool:
    """Whether threads or descriptors are above what they were."""
    return any(n > b for n, b in zip(now, before))


def _settle(before: tuple[int, int], timeout: float = 10.0) -> tuple[int, int]:
    """This process's threads and descriptors once what is ending has ended (at most `timeout`): no
    more than `before` (fewer where a thread an earlier test left has ended meanwhile)."""
    deadline = time.monotonic() + timeout
    while _above(now := _own(), before) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    return now


def test_requests_leave_no_thread_in_a_stub_or_the_client(server):
    for _ in range(2):  # the pools the first requests open (the ensemble's llm streams, the encoder's)
        generate(server.grpc_url, PROMPT, [IMAGE], max_tokens=4)
    stubs, own = _stub_threads(server.process.pid), _own()
    for _ in range(10):
        assert len(generate(server.grpc_url, PROMPT, [IMAGE], max_tokens=4).output_ids) == 4
        with pytest.raises(_Cancel):  # its stream is cancelled on the way out
            generate(server.grpc_url, PROMPT, [IMAGE], max_tokens=400, on_text=_cancel)
        with pytest.raises(RequestError, match=r"images\[0\]"):
            generate(server.grpc_url, PROMPT, [b"not an image"], max_tokens=4)
    wait_for(server, lambda m: m.get("triton_vlm_llm_kv_blocks:used") == 0)
    settled = _settle(own)
    assert not _above(settled, own), (settled, own, _descriptors())
    deadline = time.monotonic() + 10  # (a cancelled stream's threads end a moment after it)
    while (now := _stub_threads(server.process.pid)) != stubs and time.monotonic() < deadline:
        time.sleep(0.1)
    assert now == stubs


@pytest.fixture(scope="module")
def front_repo(tiny_checkpoint, tmp_path_factory) -> Path:
    """A repository of one model, the `vision_encoder` front with one instance: the quickest of the
    models to start and stop (it holds no weights), a Python model as every step is, and one that
    answers a request of zero media items by itself."""
    from triton_vlm.repository.build import build_repository
    from triton_vlm.repository.options import BuildOptions

    root = tmp_path_factory.mktemp("leaks")
    built = build_repository(tiny_checkpoint, root / "built", BuildOptions(encoder_frontends=1))
    shutil.copytree(built / "vision_encoder", root / "repository" / "vision_encoder", symlinks=True)
    return root / "repository"


def _no_items(url: str) -> tuple[int, ...]:
    """The front's answer to a request of zero items: the shape of its embeddings."""
    width = int(np.prod(np.atleast_1d(_input_dims(url)["pixel_values"][-1])))
    inputs = grpc_inputs({"pixel_values": (np.zeros((0, width), np.float32), "FP32"),
                          "grid_thw": (np.zeros((0, 3), np.int64), "INT64")})
    with grpcclient.InferenceServerClient(url) as client:
        return client.infer("vision_encoder", inputs).as_numpy("embeddings").shape


def _input_dims(url: str) -> dict[str, list[int]]:
    with grpcclient.InferenceServerClient(url) as client:
        return {t.name: list(t.dims) for t in client.get_model_config("vision_encoder").config.input}


def _wait_event(events: list[str], wanted: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while wanted not in events and time.monotonic() < deadline:
        time.sleep(0.05)
    assert wanted in events, "\n".join(events)


def test_supervised_servers_one_after_another_leave_nothing_behind(front_repo):
    """Every fourth server has a stub killed (the supervisor reloads its model), every fourth
    tritonserver itself (restarted; a client retries meanwhile, as the faults tests' do); half are
    stopped as `serve` stops on SIGTERM, half with `stop`. What the process holds is compared from
    the end of the first, which starts the process-wide pools (gRPC's)."""
    from triton_vlm.server.tritonserver import TritonServer

    regions: set[str] = set()
    markers: set[Path] = set()  # the folders of the stubs' exit markers, one a start
    processes: set[tuple[int, int]] = set()  # (pid, start): a pid alone may name a later process
    for i in range(SERVERS):
        if i == 1:  # once the first has started gRPC's and the supervisor's process-wide pools
            own, children = _own(), set(_children())
        events: list[str] = []
        server = TritonServer(front_repo, supervise=True, report=events.append).start(timeout=120)
        markers.add(Path(server.stub_exits))
        try:
            expected = _no_items(server.grpc_url)
            with pytest.raises(RequestError):  # a stream refused: this repository has no ensemble
                generate(server.grpc_url, PROMPT, max_tokens=4)
            if i % 4 == 1:
                stub = next(pid for pid, name in server.stub_processes().items() if name == "vision_encoder_0_0")
                regions |= mapped_regions([server.process.pid])
                os.kill(stub, signal.SIGKILL)
                _wait_event(events, "model 'vision_encoder' reloaded")
            elif i % 4 == 3:
                regions |= mapped_regions(group_members(server.process.pid))
                processes |= _processes(server.process.pid)
                os.kill(server.process.pid, signal.SIGKILL)
                with pytest.raises(RequestError):  # while it restarts
                    generate(server.grpc_url, PROMPT, [IMAGE], max_tokens=4, timeout=30)
                _wait_event(events, "tritonserver restarted")
            assert _no_items(server.grpc_url) == expected
            markers.add(Path(server.stub_exits))
            regions |= mapped_regions(group_members(server.process.pid))
            processes |= _processes(server.process.pid)
        finally:
            if i % 2:
                server.forward_signal(signal.SIGTERM)
                server.wait()
            else:
                server.stop()
    assert regions and not [r for r in regions if Path("/dev/shm", r).exists()]
    assert len(markers) == SERVERS + SERVERS // 4 and not [m for m in markers if m.exists()]
    left = [command for pid, start in processes if (command := _running(pid, start))]
    assert not left, f"processes of stopped servers are left: {left}"
    assert set(_children()) == children, "a child process of this one is left"
    settled = _settle(own)
    assert not _above(settled, own), (settled, own, threading.enumerate())


def _start(pid: int) -> int:
    """When `pid` started (clock ticks since boot; 0 once it is gone)."""
    try:
        return int(proc_stat(pid)[19])
    except (OSError, IndexError, ValueError):
        return 0


def _running(pid: int, start: int) -> str | None:
    """The command line of process `pid` started at `start` if it still runs (not a later process
    with its pid, not one that has exited and waits for init to reap it)."""
    try:
        stat, command = proc_stat(pid), Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if int(stat[19]) != start or stat[0] == "Z":
        return None
    return command.replace(bytes(1), b" ").decode(errors="replace")[:200]


def _processes(server_pid: int) -> set[tuple[int, int]]:
    """The server's processes now (its group: the server, its stubs, their watchers), with their starts."""
    return {(pid, _start(pid)) for pid in group_members(server_pid)}


def _children() -> list[int]:
    return [int(p) for task in Path("/proc/self/task").iterdir() for p in (task / "children").read_text().split()]
