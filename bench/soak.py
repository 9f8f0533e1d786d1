"""Soak a deployment: `triton-vlm serve` under mixed requests, cancelled streams and bad inputs at a
fixed concurrency, its processes sampled throughout, optionally with faults.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/soak.py --duration 3600 --concurrency 8 --faults 120

Builds the repository of the `small` demo checkpoint (written if missing) and runs `triton-vlm
serve` on it in a process of its own, on free ports, as a deployment runs it. For `--duration`
seconds `--concurrency` clients keep it busy with good requests (text, image, video; greedy, each
checked against its answer alone), streams cancelled after two tokens, and bad inputs (each must
fail with a message naming the input).

Every `--sample-every` seconds it samples each process of the deployment by role (the serve
process, tritonserver, each model's stubs, their watchers, the llm's ranks: threads, resident
memory, open descriptors), the Python backend's regions in /dev/shm and the KV blocks in use. After
the warm-up (`--warmup`, default the first 10 minutes, a third of a shorter run) it prints each
one's trend (`triton_vlm.server.growth`: slope per hour, and whether its floor rose above its
earlier ceiling) and fails when threads, descriptors or /dev/shm regions rise, or when the
deployment's memory grows more than `--memory-bound` percent an hour (default 1; 2 with faults).
The deployment's memory is the sum of its processes' proportional set sizes (`all pss`: a page
shared by several processes counted once; `triton_vlm.server.process_tree.Usage`); the sum of
their RSS (`all rss`) is printed beside it.

With `--faults SECONDS`, every SECONDS one of FAULT_TARGETS is killed with SIGKILL in turn (a
step's first stub, or tritonserver itself). A request that then fails with UNAVAILABLE ("the
<step> step restarted; retry", or gRPC's own while the server restarts) counts as such, one with
no answer within `--request-timeout` as hung; each kill's recovery is the time to the supervisor's
"reloaded" or "restarted". Exits 1 if a good request failed or was wrong, one hung, a KV block is
left in use at the end, or something grows.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import tritonclient.grpc as grpcclient

from triton_vlm.clients.client import RequestError, close_stream, generate, grpc_inputs, request_values, \
    send_on_stream, stream_error
from triton_vlm.errors import RESTARTED
from triton_vlm.families import get_family
from triton_vlm.families.demo import write_demo_checkpoint
from triton_vlm.media import samples
from triton_vlm.repository.build import build_repository
from triton_vlm.server.growth import trend
from triton_vlm.server import reaper
from triton_vlm.server.process_tree import descendants, sample, shm_regions
from triton_vlm.server.stubs import model_of, stub_processes
from triton_vlm.server.tritonserver import free_port

FAMILY = "qwen2_5_vl"
SERVER_GONE = "StatusCode.UNAVAILABLE"  # gRPC's status of a stream whose server went
FAULT_TARGETS = ("llm", "preprocess", "vision_encoder", "vision_encoder_batch", "ensemble", "tritonserver")
_EVENT = re.compile(r"^triton-vlm serve: (model '(\w+)' reloaded|tritonserver restarted)")


class Deployment:
    """`triton-vlm serve` on `repo`, on free ports; the supervisor's recoveries as (time, model or
    "*") from its output."""

    def __init__(self, repo: Path, log: Path) -> None:
        self.grpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.recoveries: list[tuple[float, str]] = []
        self._log = open(log, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "triton_vlm.tools.cli", "serve", "--repo", str(repo), "--grpc-port",
             str(self.grpc_port), "--http-port", str(self.http_port), "--metrics-port", str(self.metrics_port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        reaper.start(self.process, grace=30.0)  # a soak killed or interrupted takes its deployment with it
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(900) or self.process.poll() is not None:
            raise RuntimeError(f"triton-vlm serve did not start; see {log}")

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def _read(self) -> None:
        for line in self.process.stderr:
            self._log.write(line)
            self._log.flush()
            if line.startswith("ready: "):
                self._ready.set()
            found = _EVENT.match(line)
            if found:
                self.recoveries.append((time.monotonic(), found.group(2) or "*"))
        self._ready.set()

    def server_pid(self) -> int | None:
        """The tritonserver the serve process runs now."""
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                if Path(f"/proc/{child}/comm").read_text().strip() == "tritonserver":
                    return int(child)
        return None

    def kv_blocks_used(self) -> float | None:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        except OSError:  # (restarting)
            return None
        found = re.search(r'triton_vlm_llm_kv_blocks\{[^}]*state="used"[^}]*\} (\S+)', text)
        return float(found.group(1)) if found else None

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(60)
        self._log.close()
        return code


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


def inject_faults(deployment: Deployment, every: float, until: float, kills: list[tuple[str, float]]) -> None:
    """Every `every` seconds until `until`, SIGKILL the next of FAULT_TARGETS."""
    turn = 0
    while time.monotonic() + every < until:
        time.sleep(every)
        target = FAULT_TARGETS[turn % len(FAULT_TARGETS)]
        turn += 1
        server = deployment.server_pid()
        if server is None:
            continue
        victims = [server] if target == "tritonserver" else sorted(
            pid for pid, name in stub_processes(server).items() if model_of(name) == target)
        if victims:
            os.kill(victims[0], signal.SIGKILL)
            kills.append((target, time.monotonic()))


def sampler(deployment: Deployment, every: float, until: float, started: float, out: list[dict]) -> None:
    """Every `every` seconds until `until`: each role's threads, RSS and descriptors, the regions in
    /dev/shm that a process of the deployment mapped (and that are still there, mapped or not) and
    the KV blocks in use, as {"t": seconds since `started`, ...}."""
    ours: set[str] = set()  # every region a process of the deployment has mapped
    while time.monotonic() < until:
        roles = sample(deployment.process.pid)
        ours |= reaper.mapped_regions(descendants(deployment.process.pid))
        regions = {name: size for name, size in shm_regions().items() if name in ours}
        out.append({"t": time.monotonic() - started, "kv_blocks_used": deployment.kv_blocks_used(),
                    "shm_regions": len(regions), "shm_bytes": sum(regions.values()),
                    "roles": {r: {"threads": u.threads, "rss": u.rss, "pss": u.pss, "fds": u.fds} for r, u in roles.items()}})
        time.sleep(every)


def judge(samples_: list[dict], warmup: float, memory_bound: float) -> tuple[list[str], list[str]]:
    """The trend table's lines and what grew beyond its bound."""
    lines, grew = [], []
    after = [s for s in samples_ if s["t"] >= warmup]
    seen = Counter(r for s in after for r in s["roles"])  # roles of lasting processes, not of one starting
    steady = sorted(r for r, n in seen.items() if n >= 0.9 * len(after))
    series = {f"{role} {metric}": [(s["t"], s["roles"].get(role, {}).get(metric, 0)) for s in samples_]
              for role in steady for metric in ("threads", "fds", "pss")}
    for metric in ("rss", "pss"):
        series[f"all {metric}"] = [(s["t"], sum(u.get(metric, 0) for u in s["roles"].values())) for s in samples_]
    series["/dev/shm regions"] = [(s["t"], s["shm_regions"]) for s in samples_]
    for name, points in series.items():
        t = trend(points, warmup)
        if t is None:
            continue
        memory = name.endswith(("rss", "pss"))
        scale, unit = (2**20, "MB") if memory else (1, "")
        lines.append(f"  {name:34s} {t.first / scale:10.1f} -> {t.last / scale:10.1f}{unit:2s}  "
                     f"{t.slope_per_hour / scale:+9.2f}{unit}/h" + (f" ({t.percent_per_hour:+.2f}%/h)" if memory else "")
                     + ("  RISES" if t.rises and not memory else ""))
        if (not memory and t.rises) or (name == "all pss" and t.percent_per_hour > memory_bound):
            grew.append(name)
    return lines, grew


def soak_requests() -> tuple[dict[str, tuple[str, list[bytes], list[bytes]]],
                             dict[str, tuple[str, list[bytes], list[bytes], str]]]:
    """The soak's requests: good ones by kind (prompt, images, videos), and bad ones by case (the
    same, and the input their refusal must name)."""
    family = get_family(FAMILY)
    chat = lambda text: f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"  # noqa: E731
    video = samples.video_bytes(2.0, 10, 320, 240)
    good = {
        "text": (chat("Tell me about the road."), [], []),
        "image": (chat(family.image_placeholder + "What is this?"), [samples.image_bytes(448, 336)], []),
        "video": (chat(family.video_placeholder + "What moves?"), [], [video]),
    }
    bad = {
        "corrupt image": (chat(family.image_placeholder + "?"), [b"\xff\xd8\xff not a jpeg" * 10], [], "images[0]"),
        "truncated video": (chat(family.video_placeholder + "?"), [], [video[:2000]], "videos[0]"),
        "placeholders": (chat(family.image_placeholder * 2 + "?"), good["image"][1], [], "text_input"),
    }
    return good, bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--workdir", default="build/soak")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=float, default=0.0, help="kill one of FAULT_TARGETS every this many s")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds without an answer after which a request counts as hung")
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, help="seconds before trends count (default 600, or a third)")
    parser.add_argument("--memory-bound", type=float, help="%% an hour the memory (all pss) may grow (default 1, 2 with faults)")
    parser.add_argument("--json", help="write the samples and the verdict here")
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else min(600.0, args.duration / 3)
    memory_bound = args.memory_bound if args.memory_bound is not None else (2.0 if args.faults else 1.0)

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = workdir / f"{FAMILY}-{args.size}"
    if not (checkpoint / "config.json").exists():
        write_demo_checkpoint(FAMILY, checkpoint, args.size)
    repo = build_repository(checkpoint, workdir / "repository")
    good, bad = soak_requests()

    deployment = Deployment(repo, workdir / "serve.log")
    url = deployment.grpc_url
    try:
        expected = {k: generate(url, p, i, v, max_tokens=32).output_ids for k, (p, i, v) in good.items()}
        counts: Counter = Counter()
        failures: list[str] = []
        lock = threading.Lock()
        started = time.monotonic()
        deadline = started + args.duration

        def worker(index: int) -> None:
            rng = random.Random(args.seed * 1000 + index)
            while time.monotonic() < deadline:
                roll = rng.random()
                try:
                    if roll < 0.6:
                        kind = rng.choice(list(good))
                        prompt, images, videos = good[kind]
                        ids = generate(url, prompt, images, videos, max_tokens=32, timeout=args.request_timeout).output_ids
                        outcome = f"good {kind}" if ids == expected[kind] else f"WRONG {kind}"
                    elif roll < 0.8:
                        cancelled_stream(url, *good["image"][:2], args.request_timeout)
                        outcome = "cancelled stream"
                    else:
                        case = rng.choice(list(bad))
                        prompt, images, videos, named = bad[case]
                        try:
                            generate(url, prompt, images, videos, max_tokens=8, timeout=args.request_timeout)
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

        kills: list[tuple[str, float]] = []
        taken: list[dict] = []
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.concurrency)]
        threads.append(threading.Thread(target=sampler, args=(deployment, args.sample_every, deadline, started, taken)))
        if args.faults > 0:
            threads.append(threading.Thread(target=inject_faults, args=(deployment, args.faults, deadline, kills)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        idle_deadline = time.monotonic() + 30
        while (blocks := deployment.kv_blocks_used()) != 0 and time.monotonic() < idle_deadline:
            time.sleep(0.2)
    finally:
        deployment.stop()

    lines, grew = judge(taken, warmup, memory_bound)
    print(f"soak: {elapsed:.0f} s at concurrency {args.concurrency}, {sum(counts.values())} requests, "
          f"{len(taken)} samples, trends after {warmup:.0f} s")
    for outcome, n in sorted(counts.items()):
        print(f"  {outcome:34s} {n}")
    print(f"  good requests failed or wrong        {len(failures)} (must be 0)")
    print(f"  hung                                 {counts['HUNG']} (must be 0)")
    for model, at in kills:
        back = next((t for t, m in deployment.recoveries if m in (model, "*") and t > at), None)
        print(f"  killed {model:22s} at {at - started:7.1f} s, serving again after "
              + (f"{back - at:.1f} s" if back else "never"))
    for failure in failures[:10]:
        print(f"    {failure}")
    print(f"  KV blocks in use at the end          {blocks} (must be 0)")
    print(f"  trends (value at the warm-up's end -> at the end, slope; memory (all pss) must grow < {memory_bound:g}%/h):")
    print("\n".join(lines))
    print(f"  grew: {', '.join(grew) or 'nothing'}")
    ok = not failures and counts["HUNG"] == 0 and blocks == 0 and not grew
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "counts": counts, "failures": failures,
                                               "kills": [(m, at - started) for m, at in kills], "grew": grew,
                                               "kv_blocks_end": blocks, "samples": taken, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
