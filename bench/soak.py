"""Soak the ensemble: mixed requests, cancelled streams and bad inputs at a fixed concurrency.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/soak.py --duration 300 --concurrency 8

Builds the repository of the `small` demo checkpoint (written if missing), starts a server on
free ports, and for `--duration` seconds keeps `--concurrency` clients busy with: good requests
(text, image, video; greedy, each checked against its answer alone), streams cancelled after two
tokens, and bad inputs (each must fail with a message naming the input). Reports good requests
that failed (must be 0), tritonserver + stub RSS at start and end, and KV blocks in use at the
end (must be 0). Exits 1 if either must-be-0 is not.

With `--faults SECONDS` the server is supervised (as `triton-vlm serve` runs it) and every SECONDS
one stub is killed with SIGKILL, rotating over the steps (`FAULT_STEPS`). A request that then
fails with UNAVAILABLE ("the <step> step restarted; retry"; or gRPC's own, while the supervisor
restarts the server: after the ensemble's death, or tritonserver's) counts as such, one with no
answer within `--request-timeout` as hung (must be 0); each kill's time to recovery is the time
from the kill to the supervisor's reload or restart.
"""
from __future__ import annotations

import argparse
import os
import queue
import random
import re
import signal
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import tritonclient.grpc as grpcclient

from triton_vlm.clients.client import RequestError, close_stream, generate, grpc_inputs, request_values, send_on_stream, stream_error
from triton_vlm.errors import RESTARTED
from triton_vlm.families import get_family
from triton_vlm.families.demo import write_demo_checkpoint
from triton_vlm.media import samples
from triton_vlm.repository.build import build_repository
from triton_vlm.server.tritonserver import TritonServer

FAMILY = "qwen2_5_vl"
# gRPC's status of a stream whose server went (the supervisor restarts it)
SERVER_GONE = "StatusCode.UNAVAILABLE"
# The steps whose stub `--faults` kills, in turn.
FAULT_STEPS = ("llm", "preprocess", "vision_encoder", "vision_encoder_batch", "ensemble")


def rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants (the Python backend stubs), in MB."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
        except (OSError, AttributeError):
            pass
        todo.extend(children.get(p, []))
    return total / 1024


def kv_blocks_used(server: TritonServer) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return float(re.search(r'triton_vlm_llm_kv_blocks\{[^}]*state="used"[^}]*\} (\S+)', text).group(1))


def cancelled_stream(url: str, prompt: str, images: list[bytes], timeout: float) -> None:
    """Start a long stream and cancel it after two responses."""
    inputs = grpc_inputs(request_values(prompt, images, max_tokens=1000, stream=True))
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            send_on_stream(client, "ensemble", inputs)
            for _ in range(2):
                _, error = responses.get(timeout=timeout)  # queue.Empty: hung
                if error is not None:
                    raise RequestError(f"cancelled stream failed before cancelling: {stream_error(error)}")
        finally:
            close_stream(client, cancel=True)


def inject_faults(server: TritonServer, every: float, until: float, kills: list[tuple[str, float]]) -> None:
    """Every `every` seconds until `until`, SIGKILL the first stub of the next of FAULT_STEPS;
    append (model, time of the kill) to `kills`."""
    turn = 0
    while time.monotonic() + every < until:
        time.sleep(every)
        model = FAULT_STEPS[turn % len(FAULT_STEPS)]
        turn += 1
        victims = sorted(pid for pid, name in server.stub_processes().items() if name.startswith(f"{model}_"))
        if victims:
            os.kill(victims[0], signal.SIGKILL)
            kills.append((model, time.monotonic()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--workdir", default="build/soak")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=float, default=0.0,
                        help="kill one step's stub every this many seconds (0: none)")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds without an answer after which a request counts as hung")
    args = parser.parse_args()

    workdir = Path(args.workdir)
    checkpoint = workdir / f"{FAMILY}-{args.size}"
    if not (checkpoint / "config.json").exists():
        write_demo_checkpoint(FAMILY, checkpoint, args.size)
    repo = build_repository(checkpoint, workdir / "repository")
    family = get_family(FAMILY)
    chat = lambda text: f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"  # noqa: E731
    good = {
        "text": (chat("Tell me about the road."), [], []),
        "image": (chat(family.image_placeholder + "What is this?"), [samples.image_bytes(448, 336)], []),
        "video": (chat(family.video_placeholder + "What moves?"), [], [samples.video_bytes(2.0, 10, 320, 240)]),
    }
    bad = {
        "corrupt image": (chat(family.image_placeholder + "?"), [b"\xff\xd8\xff not a jpeg" * 10], [], "images[0]"),
        "truncated video": (chat(family.video_placeholder + "?"), [], [good["video"][2][0][:2000]], "videos[0]"),
        "placeholders": (chat(family.image_placeholder * 2 + "?"), [good["image"][1][0]], [], "text_input"),
    }

    reloads: list[tuple[str, float]] = []

    def report(message: str) -> None:
        print(f"  server: {message}", flush=True)
        found = re.match(r"model '(\w+)' reloaded", message)
        if found:
            reloads.append((found.group(1), time.monotonic()))
        elif message == "tritonserver restarted":  # every model is back
            reloads.append(("*", time.monotonic()))

    with TritonServer(repo, log_file=workdir / "tritonserver.log", supervise=args.faults > 0, report=report) as server:
        expected = {k: generate(server.grpc_url, p, i, v, max_tokens=32).output_ids for k, (p, i, v) in good.items()}
        rss_start = rss_mb(server.process.pid)
        counts: Counter = Counter()
        failures: list[str] = []
        lock = threading.Lock()
        deadline = time.monotonic() + args.duration

        def worker(index: int) -> None:
            rng = random.Random(args.seed * 1000 + index)
            while time.monotonic() < deadline:
                roll = rng.random()
                try:
                    if roll < 0.6:
                        kind = rng.choice(list(good))
                        prompt, images, videos = good[kind]
                        ids = generate(server.grpc_url, prompt, images, videos, max_tokens=32,
                                       timeout=args.request_timeout).output_ids
                        outcome = f"good {kind}" if ids == expected[kind] else f"WRONG {kind}"
                    elif roll < 0.8:
                        cancelled_stream(server.grpc_url, *good["image"][:2], args.request_timeout)
                        outcome = "cancelled stream"
                    else:
                        case = rng.choice(list(bad))
                        prompt, images, videos, named = bad[case]
                        try:
                            generate(server.grpc_url, prompt, images, videos, max_tokens=8,
                                     timeout=args.request_timeout)
                            outcome = f"WRONG accepted {case}"
                        except RequestError as error:
                            if RESTARTED in str(error) or SERVER_GONE in str(error):
                                raise
                            outcome = f"bad {case}" if named in str(error) else f"WRONG message {case}: {error}"
                except RequestError as error:
                    outcome = ("unavailable (step restarted)" if RESTARTED in str(error) else
                               "unavailable (server restarting)" if SERVER_GONE in str(error) else f"FAILED: {error}")
                    time.sleep(0.1)  # a client's back-off before it retries
                except queue.Empty:
                    outcome = "HUNG"
                except Exception as error:  # a good request that failed
                    outcome = f"FAILED: {type(error).__name__}: {error}"
                with lock:
                    counts[outcome.split(":")[0]] += 1
                    if outcome.startswith(("WRONG", "FAILED", "HUNG")):
                        failures.append(outcome)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.concurrency)]
        kills: list[tuple[str, float]] = []
        if args.faults > 0:
            threads.append(threading.Thread(target=inject_faults, args=(server, args.faults, deadline, kills)))
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        idle_deadline = time.monotonic() + 30
        while (blocks := kv_blocks_used(server)) and time.monotonic() < idle_deadline:
            time.sleep(0.2)
        rss_end = rss_mb(server.process.pid)

    print(f"soak: {elapsed:.0f} s at concurrency {args.concurrency}, {sum(counts.values())} requests")
    for outcome, n in sorted(counts.items()):
        print(f"  {outcome:32s} {n}")
    print(f"  good requests failed or wrong      {len(failures)} (must be 0)")
    if args.faults > 0:
        print(f"  hung                               {counts['HUNG']} (must be 0)")
        for model, at in kills:
            back = next((t for m, t in reloads if m in (model, "*") and t > at), None)
            print(f"  killed {model:22s} at {at - started:6.1f} s, serving again after "
                  + (f"{back - at:.1f} s" if back else "never"))
    for failure in failures[:10]:
        print(f"    {failure}")
    print(f"  server RSS (tritonserver + stubs)  {rss_start:.0f} MB at start, {rss_end:.0f} MB at end")
    print(f"  KV blocks in use at the end        {blocks:.0f} (must be 0)")
    return 0 if not failures and blocks == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
