"""Issue #6 faults through the `ensemble`: cancellation, client disconnect, overload, queue
timeouts, a dead stub, a crashed server."""
from __future__ import annotations

import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.metrics import wait_for
from tests.servers import served
from triton_vlm.clients.client import (RequestError, close_stream, generate, generate_payload, grpc_inputs,
                                       http_generate, request_values)
from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL
from triton_vlm.media import samples

PROMPT = "<|im_start|>user\nTell me a long story about a red car.<|im_end|>\n<|im_start|>assistant\n"
LONG = 3000  # tokens asked for; the tiny model's context is 4096


def _inputs(max_tokens: int) -> list:
    return grpc_inputs(request_values(PROMPT, max_tokens=max_tokens, stream=True))


def _idle(values: dict) -> bool:
    return (values.get("triton_vlm_llm_requests:running") == 0 and values.get("triton_vlm_llm_requests:waiting") == 0
            and values.get("triton_vlm_llm_kv_blocks:used") == 0)


def test_cancelled_stream_stops_the_llm_and_frees_its_blocks(server):
    before = wait_for(server, _idle)["triton_vlm_llm_generated_tokens"]
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("ensemble", _inputs(LONG))
        received = 0
        while received < 5:
            result, error = responses.get(timeout=60)
            assert error is None
            received += 1
        busy = wait_for(server, lambda v: v.get("triton_vlm_llm_kv_blocks:used", 0) > 0, timeout=10)
        assert busy["triton_vlm_llm_kv_blocks:used"] > 0  # metrics refresh every 100 ms
        client.stop_stream(cancel_requests=True)
    after = wait_for(server, _idle, timeout=10)
    assert _idle(after)
    generated = after["triton_vlm_llm_generated_tokens"] - before
    # Stopped by the ensemble's cancellation watcher (20 ms poll) plus one step, nowhere near the
    # 3000 asked for. How far the llm is past what the client saw depends on how fast it decodes
    # against the ensemble's forwarding, and on the metrics wait above (refreshed every 100 ms): on
    # the tiny model a few hundred tokens at most.
    assert received <= generated < 500, generated


def test_client_killed_mid_stream_stops_the_llm(server):
    before = wait_for(server, _idle)["triton_vlm_llm_generated_tokens"]
    client = textwrap.dedent(f"""
        import queue, sys, time
        import tritonclient.grpc as grpcclient
        from tests.test_faults import _inputs
        responses = queue.Queue()
        client = grpcclient.InferenceServerClient({server.grpc_url!r})
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("ensemble", _inputs({LONG}))
        responses.get(timeout=60)
        print("streaming", flush=True)
        time.sleep(600)
    """)
    process = subprocess.Popen([sys.executable, "-c", client], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "streaming"
        process.kill()  # no cancel, no goodbye: the connection just drops
    finally:
        process.kill()
        process.wait()
    after = wait_for(server, _idle, timeout=10)
    assert _idle(after)
    assert after["triton_vlm_llm_generated_tokens"] - before < LONG // 10


@pytest.fixture(scope="module")
def one_slot_server(tiny_checkpoint, tmp_path_factory):
    """A server whose `ensemble` takes one request at a time."""
    from triton_vlm.repository.options import BuildOptions

    options = BuildOptions(max_inflight_requests=1, preprocess_instances=1, encoder_frontends=1)
    with served(tiny_checkpoint, tmp_path_factory, "one-slot", options) as running:
        yield running


def test_overload_is_a_quick_unavailable_and_the_running_request_completes(one_slot_server):
    """A request past the ensemble's one slot is refused at once; the one running goes on (it is
    long enough to outlast the refusal on any machine, and cancelled once that is seen)."""
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(one_slot_server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("ensemble", grpc_inputs(request_values(PROMPT, max_tokens=LONG, min_tokens=LONG)))
        result, error = responses.get(timeout=60)
        assert error is None
        started = time.perf_counter()
        with pytest.raises(RequestError, match="server busy: 1 requests in flight, max_inflight_requests=1"):
            generate(one_slot_server.grpc_url, PROMPT, max_tokens=4)
        refused_in = time.perf_counter() - started
        for _ in range(20):  # the running request streams on
            result, error = responses.get(timeout=60)
            assert error is None and result.as_numpy("finish_reason")[0] == b""
        close_stream(client, cancel=True)
        assert refused_in < 5
    assert _idle(wait_for(one_slot_server, _idle))
    deadline = time.monotonic() + 10  # the slot is free once the cancelled request's last response went
    while True:
        try:
            assert len(generate(one_slot_server.grpc_url, PROMPT, max_tokens=4).output_ids) == 4
            break
        except RequestError as error:
            assert "server busy" in str(error) and time.monotonic() < deadline, error
            time.sleep(0.1)


def test_queue_limits_are_build_options(tiny_checkpoint):
    """Triton's queues of the non-decoupled models and the llm's own queue, from BuildOptions and
    `triton-vlm build` flags (each config is parsed back by write_config when built)."""
    import json

    from tritonclient.grpc import model_config_pb2 as mc

    from triton_vlm.families import detect_family
    from triton_vlm.repository.configs import model_configs
    from triton_vlm.repository.options import BuildOptions
    from triton_vlm.tools.cli import build_options, parser

    args = parser().parse_args(["build", "--checkpoint", "c", "--repo", "r", "--queue-timeout-ms", "1500",
                                "--max-queue-size", "7", "--llm-queue-timeout-ms", "250", "--max-inflight-requests", "3"])
    options = build_options(args)
    assert options == BuildOptions(queue_timeout_ms=1500, max_queue_size=7, llm_queue_timeout_ms=250,
                                   max_inflight_requests=3)
    configs = model_configs(detect_family(tiny_checkpoint), json.loads((tiny_checkpoint / "config.json").read_text()),
                            options)
    for name in ("preprocess", "vision_encoder", "vision_encoder_batch"):
        policy = configs[name].dynamic_batching.default_queue_policy
        assert (policy.timeout_action, policy.default_timeout_microseconds, policy.max_queue_size) == \
            (mc.ModelQueuePolicy.REJECT, 1_500_000, 7), name
    assert configs["preprocess"].max_batch_size == configs["vision_encoder"].max_batch_size == 0
    for name in ("llm", "ensemble"):  # decoupled: execute only hands the request on
        assert not configs[name].HasField("dynamic_batching"), name
    assert configs["llm"].parameters["queue_timeout_ms"].string_value == "250"
    assert configs["ensemble"].parameters["max_inflight_requests"].string_value == "3"


@pytest.fixture(scope="module")
def queue_server(tiny_checkpoint, tmp_path_factory):
    """A server whose llm runs one request at a time and lets the next wait 200 ms at most, and
    whose vision_encoder_batch holds every request 2 s for a batch, past the 1 s queue timeout."""
    from triton_vlm.repository.options import BuildOptions

    options = BuildOptions(llm_max_running=1, llm_queue_timeout_ms=200, queue_timeout_ms=1000, max_queue_size=16,
                           encoder_max_queue_delay_us=2_000_000, preprocess_instances=1, encoder_frontends=1)
    with served(tiny_checkpoint, tmp_path_factory, "queue", options) as running:
        yield running


def test_a_request_waiting_for_the_llm_past_its_timeout_is_unavailable(queue_server):
    busy = r"server busy: waited \d+ ms for a place in the llm batch, llm_queue_timeout_ms=200; retry later"
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(queue_server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("ensemble", _inputs(LONG))  # takes the llm's one place
        result, error = responses.get(timeout=60)
        assert error is None
        # A client of the decoupled ensemble sees the message only (Triton 2.51: gRPC streaming
        # carries no code, HTTP generate answers 400 to every error).
        with pytest.raises(RequestError, match=busy):
            generate(queue_server.grpc_url, PROMPT, max_tokens=4)
        with pytest.raises(RequestError, match=busy):
            http_generate(queue_server.http_url, generate_payload(PROMPT, max_tokens=4))
        result, error = responses.get(timeout=60)  # the long request goes on streaming
        assert error is None and not result.as_numpy("finish_reason")[0]
        client.stop_stream(cancel_requests=True)
    after = wait_for(queue_server, _idle, timeout=10)
    assert _idle(after)  # the refused requests left nothing behind
    assert len(generate(queue_server.grpc_url, PROMPT, max_tokens=4).output_ids) == 4


def test_a_request_past_a_triton_queue_timeout_is_unavailable(queue_server, tiny_checkpoint):
    """vision_encoder_batch's queue policy refuses the request (it waits for a batch longer than its
    timeout); vision_encoder answers UNAVAILABLE, the ensemble passes the message on."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from triton_vlm.families.qwen2_5_vl.tower import Qwen2_5_VLTower

    client = httpclient.InferenceServerClient(queue_server.http_url)
    try:
        for name in ("preprocess", "vision_encoder", "vision_encoder_batch"):
            policy = client.get_model_config(name)["dynamic_batching"]["default_queue_policy"]
            assert (policy["timeout_action"], policy["default_timeout_microseconds"], policy["max_queue_size"]) == \
                ("REJECT", 1_000_000, 16), name
    finally:
        client.close()
    refused = "vision_encoder_batch: Request timeout expired"
    grid = np.array([[1, 4, 4]], np.int64)
    patch_dim = Qwen2_5_VLTower.read_vision_config(tiny_checkpoint)["patch_dim"]
    inputs = [grpcclient.InferInput("pixel_values", [16, patch_dim], "FP32"),
              grpcclient.InferInput("grid_thw", list(grid.shape), "INT64")]
    inputs[0].set_data_from_numpy(np.zeros(inputs[0].shape(), np.float32))
    inputs[1].set_data_from_numpy(grid)
    with grpcclient.InferenceServerClient(queue_server.grpc_url) as client, \
            pytest.raises(InferenceServerException) as error:
        client.infer("vision_encoder", inputs)
    assert error.value.status() == "StatusCode.UNAVAILABLE" and refused in error.value.message()
    prompt, image = QWEN2_5_VL.image_placeholder + "What is this?", samples.image_bytes(64, 48)
    with pytest.raises(RequestError, match=refused):
        generate(queue_server.grpc_url, prompt, [image], max_tokens=4)


def _children(pid: int) -> list[int]:
    return [int(p) for task in Path(f"/proc/{pid}/task").iterdir()
            for p in (task / "children").read_text().split()]


def _exited(pidfds: dict[int, int], timeout: float = 60.0) -> set[int]:
    """Wait for the processes of `pidfds` (pid -> pidfd) to exit; the pids still running at the timeout."""
    poller = select.poll()
    for fd in pidfds.values():
        poller.register(fd, select.POLLIN)
    left, deadline = set(pidfds), time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        ready = {fd for fd, _ in poller.poll(500)}
        left -= {pid for pid in left if pidfds[pid] in ready}
    return left


def _kill_and_close(pidfds: dict[int, int]) -> None:
    for fd in pidfds.values():
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(fd)


@pytest.mark.parametrize("goes_first", ["server", "stub", "no tritonserver"])
def test_a_stub_watcher_kills_its_stub_when_the_server_goes_and_ends_with_the_stub(goes_first, tmp_path):
    """triton_vlm.server.stub_watch with stand-in processes: a "server" (Python run as `tritonserver`)
    whose child "stub" starts a watcher. A stub whose parent is no tritonserver (a server killed
    while it loaded the model leaves its stub to init) is killed at once."""
    stub_code = "from triton_vlm.server import stub_watch; import time; stub_watch.start(); time.sleep(600)"
    server_code = ("import subprocess, sys, time; stub = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
                   "print(stub.pid, flush=True); time.sleep(600)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    program = tmp_path / "tritonserver"  # the name the process runs under is what the watcher checks
    program.symlink_to(sys.executable)
    if goes_first == "no tritonserver":
        program = Path(sys.executable)
    server = subprocess.Popen([str(program), "-c", server_code, stub_code], stdout=subprocess.PIPE, text=True, env=env)
    pidfds = {server.pid: os.pidfd_open(server.pid)}
    try:
        stub = int(server.stdout.readline())
        pidfds[stub] = os.pidfd_open(stub)
        if goes_first == "no tritonserver":
            assert not _exited({stub: pidfds[stub]})
            assert server.poll() is None
            return
        deadline = time.monotonic() + 60
        while not (watcher := _children(stub)) and time.monotonic() < deadline:
            time.sleep(0.05)
        pidfds[watcher[0]] = os.pidfd_open(watcher[0])
        assert _exited({stub: pidfds[stub]}, timeout=1.0) == {stub}  # the watcher leaves a served stub be
        signal.pidfd_send_signal(pidfds[server.pid if goes_first == "server" else stub], signal.SIGKILL)
        if goes_first == "server":
            assert not _exited({pid: pidfds[pid] for pid in (stub, watcher[0])})  # killed, then done
        else:
            assert not _exited({watcher[0]: pidfds[watcher[0]]})
            assert server.poll() is None  # the watcher never touches the server
    finally:
        _kill_and_close(pidfds)
        server.wait()


def test_tritonserver_and_its_stubs_exit_when_the_python_process_that_started_it_is_killed(lean_repo):
    """A process holding a `TritonServer` that is SIGKILLed with its whole process group (a killed
    test run, a CI timeout) cannot stop it: the server's reaper (triton_vlm.server.reaper, in a
    session of its own) sends it SIGTERM instead, and it shuts down with its stubs and their
    watchers, its shared-memory regions removed. The server is started from a thread that has
    ended by then: the kernel's parent-death signal would have fired at that thread's end."""
    code = ("import sys, threading, time; from triton_vlm.server.tritonserver import TritonServer; started = []; "
            "t = threading.Thread(target=lambda: started.append(TritonServer(sys.argv[1]).start())); t.start(); "
            "t.join(); print(started[0].process.pid, flush=True); time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code, str(lean_repo)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parent.parent, start_new_session=True)
    pidfds: dict[int, int] = {}
    try:
        server_pid = int(owner.stdout.readline())
        pidfds[server_pid] = os.pidfd_open(server_pid)
        stubs = [pid for pid in _children(server_pid)
                 if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"triton_python_backend_stub")]
        watchers = [child for pid in stubs for child in _children(pid)]
        pidfds.update({pid: os.pidfd_open(pid) for pid in stubs + watchers})
        regions = set(re.findall(r"/dev/shm/triton_python_backend_shm_region\S*",
                                 Path(f"/proc/{server_pid}/maps").read_text()))
        assert len(stubs) >= 5 and len(watchers) == len(stubs) and len(regions) >= len(stubs)
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait()
        assert not _exited(pidfds), "tritonserver, a stub or a watcher outlived the process that started it"
        deadline = time.monotonic() + 10  # (the reaper removes them once the last stub has gone)
        while (left := [r for r in regions if Path(r).exists()]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left
    finally:
        _kill_and_close(pidfds)
        owner.kill()
        owner.wait()
        owner.stdout.close()


def test_every_stub_exits_when_tritonserver_is_killed(lean_repo, tmp_path):
    """SIGKILL tritonserver while a request streams, so that stub threads are waiting on it (the
    llm's metrics and responses, the ensemble's BLS calls): every stub, and the watcher process
    each one starts (triton_vlm.server.stub_watch), is gone within a bounded wait; the shared-memory
    regions the dead server leaves in /dev/shm are removed by its reaper, with no `stop`."""
    from triton_vlm.server.tritonserver import TritonServer

    server = TritonServer(lean_repo, log_file=tmp_path / "server.log").start()
    maps = Path(f"/proc/{server.process.pid}/maps").read_text()
    regions = set(re.findall(r"/dev/shm/triton_python_backend_shm_region\S*", maps))
    stubs = server.stub_processes()
    watchers = {child: stubs[pid] for pid in stubs for child in _children(pid)}
    pidfds = {pid: os.pidfd_open(pid) for pid in [*stubs, *watchers]}  # exact processes, whatever reuses a pid
    try:
        assert {name.rsplit("_", 2)[0] for name in stubs.values()} == {
            "preprocess", "vision_encoder", "vision_encoder_batch", "llm", "ensemble"}
        assert sorted(watchers.values()) == sorted(stubs.values())  # one watcher per stub
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("ensemble", _inputs(LONG))
        assert responses.get(timeout=60)[1] is None
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait()
        left = _exited(pidfds)
        assert not left, sorted(stubs.get(pid) or f"watcher of {watchers[pid]}" for pid in left)
        client.close()
        # what the dead server left in /dev/shm, its reaper removes as soon as it has gone
        assert len(regions) >= len(stubs)
        server._reaper.wait(timeout=30)
        assert not [r for r in regions if Path(r).exists()]
    finally:
        _kill_and_close(pidfds)
        server.stop()


def test_a_server_on_busy_ports_is_refused_before_it_starts(server, tiny_repo):
    """Readiness is asked over HTTP, so a second server on a busy port would take the running one's
    answers for its own (and its supervisor would reload the running one's models when it exits):
    it is refused before anything starts, naming the port, and the running server is untouched."""
    from triton_vlm.server.tritonserver import ServerError, TritonServer

    second = TritonServer(tiny_repo, http_port=server.http_port, supervise=True)
    with pytest.raises(ServerError, match=f"^HTTP port {server.http_port} already in use"):
        second.start()
    assert second.process is None and server.is_ready()


def stuck_repository(root: Path, initialize: str) -> Path:
    """A repository of one Python model, `stuck`, whose `initialize(self, args)` body is `initialize`."""
    model = root / "repository" / "stuck"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(textwrap.dedent("""\
        backend: "python"
        max_batch_size: 0
        input [{ name: "x", data_type: TYPE_INT32, dims: [1] }]
        output [{ name: "y", data_type: TYPE_INT32, dims: [1] }]
        """))
    (model / "1" / "model.py").write_text(textwrap.dedent("""\
        import pathlib
        import threading
        import triton_vlm.serving.backend.pb  # noqa: F401 (the stack dump on SIGUSR1)

        class TritonPythonModel:
            def initialize(self, args):
        """) + textwrap.indent(textwrap.dedent(initialize), " " * 8))
    return model.parent


def test_a_server_not_ready_in_time_is_stopped_and_the_error_says_where_it_stood(tmp_path):
    """A start that times out (a model that never finishes loading, as in CI) names each model's
    state, the stubs running, the server's last lines and where each stub is: its threads' Python
    stacks and its main thread's native stack. It leaves nothing behind."""
    from triton_vlm.server.tritonserver import NotReady, TritonServer

    server = TritonServer(stuck_repository(tmp_path, "threading.Event().wait()  # a load that never ends\n"))
    with pytest.raises(NotReady) as error:
        server.start(timeout=10.0)
    message = str(error.value)
    assert message.startswith("tritonserver not ready after 10 s; models: ")
    assert "; stubs: ['stuck_0']; its last lines:\n" in message and "loading: stuck:1" in message, message
    stacks = message.split("-- the stubs' Python stacks:\n", 1)[1]
    assert re.search(r'File ".*/stuck/1/model.py", line \d+ in initialize', stacks), message
    if shutil.which("gdb"):
        assert re.search(r"stub \d+ main thread:\n#0 ", stacks), message
    assert server.process.poll() is not None


def test_a_model_that_fails_its_reload_has_the_server_restarted_and_one_that_cannot_start_ends_it(tmp_path):
    """A stub dies and its model's reload fails (here its second load raises): left so, every
    request routed to it would fail for good, so the supervisor kills tritonserver to start it
    again; that start fails as well, and the supervisor gives up, `wait` returning the exit code
    for whatever runs `serve` to act on."""
    from triton_vlm.server.tritonserver import TritonServer

    marker = tmp_path / "loaded once"
    events: list[str] = []
    repo = stuck_repository(tmp_path, f"""\
        marker = pathlib.Path({str(marker)!r})
        if marker.exists():
            raise RuntimeError("this model loads once")
        marker.touch()
        """)
    server = TritonServer(repo, supervise=True, report=events.append).start(timeout=60)
    stub = next(pid for pid, name in server.stub_processes().items() if name == "stuck_0")
    os.kill(stub, signal.SIGKILL)
    waited: list[int] = []
    waiter = threading.Thread(target=lambda: waited.append(server.wait()), daemon=True)
    waiter.start()
    waiter.join(120)
    if not waited:  # (a supervisor that left the model dead and the server up)
        server.stop()
    assert waited and waited[0] != 0 and len(events) == 3, events
    assert events[0].startswith(f"model instance stuck_0 died (stub pid {stub})"), events
    assert events[1].startswith("reloading 'stuck' failed (") and "this model loads once" in events[1], events
    assert events[1].endswith("so tritonserver was killed: restarting it"), events
    assert events[2].startswith("restarting tritonserver failed: tritonserver exited with code"), events


def test_a_supervised_server_not_ready_in_time_is_started_once_more(tmp_path):
    """`triton-vlm serve`'s server gets a second start when the first is not ready in time (the
    model here hangs in its first load only); the event says where the first stood."""
    from triton_vlm.server.tritonserver import TritonServer

    marker = tmp_path / "loaded once"
    events: list[str] = []
    repo = stuck_repository(tmp_path, f"""\
        marker = pathlib.Path({str(marker)!r})
        if not marker.exists():
            marker.touch()
            threading.Event().wait()
        """)
    server = TritonServer(repo, supervise=True, report=events.append)
    with server.start(timeout=10.0):
        assert server.is_ready()
        assert len(events) == 1 and events[0].startswith("tritonserver not ready after 10 s; models: "), events
        assert re.search(r"model.py\", line \d+ in initialize", events[0]), events[0]
        assert events[0].endswith("\nstarting it again"), events[0]
