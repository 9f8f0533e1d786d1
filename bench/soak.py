"""Soak the ensemble: mixed requests, cancelled streams and bad inputs at a fixed concurrency.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/soak.py --duration 300 --concurrency 8

Builds the repository of the `small` demo checkpoint (written if missing), starts a server on
free ports, and for `--duration` seconds keeps `--concurrency` clients busy with: good requests
(text, image, video; greedy, each checked against its answer alone), streams cancelled after two
tokens, and bad inputs (each must fail with a message naming the input). Reports good requests
that failed (must be 0), tritonserver + stub RSS at start and end, and KV blocks in use at the
end (must be 0). Exits 1 if either must-be-0 is not.
"""
from __future__ import annotations

import argparse
import queue
import random
import re
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import tritonclient.grpc as grpcclient

from triton_vlm import samples
from triton_vlm.checkpoint import write_demo_checkpoint
from triton_vlm.client import RequestError, generate, grpc_inputs, request_values
from triton_vlm.families import get_family
from triton_vlm.repository import build_repository
from triton_vlm.server import TritonServer

FAMILY = "qwen2_5_vl"


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


def cancelled_stream(url: str, prompt: str, images: list[bytes]) -> None:
    """Start a long stream and cancel it after two responses."""
    inputs = grpc_inputs(request_values(prompt, images, max_tokens=1000, stream=True))
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("ensemble", inputs)
        for _ in range(2):
            _, error = responses.get(timeout=120)
            if error is not None:
                raise RuntimeError(f"cancelled stream failed before cancelling: {error}")
        client.stop_stream(cancel_requests=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--workdir", default="build/soak")
    parser.add_argument("--seed", type=int, default=0)
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

    with TritonServer(repo, log_file=workdir / "tritonserver.log") as server:
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
                        ids = generate(server.grpc_url, prompt, images, videos, max_tokens=32).output_ids
                        outcome = f"good {kind}" if ids == expected[kind] else f"WRONG {kind}"
                    elif roll < 0.8:
                        cancelled_stream(server.grpc_url, *good["image"][:2])
                        outcome = "cancelled stream"
                    else:
                        case = rng.choice(list(bad))
                        prompt, images, videos, named = bad[case]
                        try:
                            generate(server.grpc_url, prompt, images, videos, max_tokens=8)
                            outcome = f"WRONG accepted {case}"
                        except RequestError as error:
                            outcome = f"bad {case}" if named in str(error) else f"WRONG message {case}: {error}"
                except Exception as error:  # a good request that failed
                    outcome = f"FAILED: {type(error).__name__}: {error}"
                with lock:
                    counts[outcome.split(":")[0]] += 1
                    if outcome.startswith(("WRONG", "FAILED")):
                        failures.append(outcome)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.concurrency)]
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
    for failure in failures[:10]:
        print(f"    {failure}")
    print(f"  server RSS (tritonserver + stubs)  {rss_start:.0f} MB at start, {rss_end:.0f} MB at end")
    print(f"  KV blocks in use at the end        {blocks:.0f} (must be 0)")
    return 0 if not failures and blocks == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
