"""How much of tritonserver's own memory each kind of request leaves behind (issue #36): a server
of the `small` demo repository (the soak's), `--concurrency` clients sending `--requests` requests
of one kind, then of the next, and tritonserver's anonymous memory (`RssAnon`: its heap, not the
Python backend's shared regions) before and after each round, per request.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/server_memory.py --repo build/soak/repository \\
        --kinds image,image,text,cancel,bad --requests 300

`mix` is the soak's mix of them all (`--kinds mix,mix,mix,mix,mix,mix --requests 400 --concurrency 8`).

Run it again with the allocator changed (`MALLOC_ARENA_MAX=2`, or `LD_PRELOAD=.../libjemalloc.so.2`
in the environment: tritonserver inherits it) to compare allocators on the same rounds.

`--heaptrack FILE`: heaptrack is attached to tritonserver after the first warm-up and detached
after the last round (its own output in FILE.log); what the rounds allocated and did not free is printed (`heaptrack_print
--print-leaks 1 FILE.zst` shows where it was allocated). heaptrack's own memory then counts in the
rounds' figures.
"""
from __future__ import annotations

import argparse
import random
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from soak import cancelled_stream, soak_requests

from triton_vlm.clients.client import RequestError, generate
from triton_vlm.server.process_tree import proc_bytes
from triton_vlm.server.tritonserver import TritonServer

WARMUP = 40  # requests of a kind sent before its round is measured


def kinds() -> dict[str, Callable[[str], object]]:
    """kind -> one request of it to a server's gRPC url (the soak's requests)."""
    good, bad = soak_requests()
    kinds = {kind: (lambda url, r=request: generate(url, *r, max_tokens=8)) for kind, request in good.items()}
    kinds["cancel"] = lambda url: cancelled_stream(url, *good["image"][:2], 60.0)
    kinds["bad"] = lambda url: generate(url, *bad["corrupt image"][:3], max_tokens=8)
    # the soak's mix: each of the five alike often (good ones 60%, cancelled 20%, refused 20%)
    rng, each = random.Random(0), list(kinds.values())
    kinds["mix"] = lambda url: rng.choice(each)(url)
    return kinds


def anonymous_kb(pid: int) -> int:
    return proc_bytes(Path(f"/proc/{pid}/status").read_text(), "RssAnon") // 1024


def send(request: Callable[[str], object], url: str, n: int, concurrency: int) -> None:
    def one(_: int) -> None:
        try:
            request(url)
        except RequestError:  # a refused request is one of the kinds
            pass

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", required=True, help="a built repository (bench/soak.py's WORKDIR/repository)")
    parser.add_argument("--kinds", default="image,image,text,cancel,bad", help="rounds, in order: " + ",".join(kinds()))
    parser.add_argument("--requests", type=int, default=300, help="requests a round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--heaptrack", metavar="FILE", help="trace tritonserver's heap over the rounds into FILE.zst")
    args = parser.parse_args()
    requests = kinds()
    tracer = None
    with TritonServer(args.repo, supervise=True) as server:
        ends = []  # the anonymous memory after each round
        for kind in args.kinds.split(","):
            send(requests[kind], server.grpc_url, WARMUP, args.concurrency)
            if args.heaptrack and tracer is None:
                tracer = subprocess.Popen(["heaptrack", "-o", args.heaptrack, "-p", str(server.process.pid)],
                                          stdout=open(f"{args.heaptrack}.log", "w"), stderr=subprocess.STDOUT)
                time.sleep(15.0)  # (its injection through gdb)
            time.sleep(3.0)
            before, started = anonymous_kb(server.process.pid), time.monotonic()
            send(requests[kind], server.grpc_url, args.requests, args.concurrency)
            time.sleep(3.0)
            ends.append(after := anonymous_kb(server.process.pid))
            print(f"{kind}: {args.requests} requests in {time.monotonic() - started:.0f} s, tritonserver's anonymous "
                  f"memory {before} -> {after} kB, {(after - before) / args.requests:.1f} kB a request", flush=True)
        if tracer is not None:
            tracer.send_signal(signal.SIGINT)  # detach
            tracer.wait(timeout=120)  # (what it started may keep its output open longer)
    if tracer is not None:
        summary = subprocess.run(["heaptrack_print", "-f", f"{args.heaptrack}.zst", "--print-leaks", "0",
                                  "--print-peaks", "0", "--print-allocators", "0", "--print-temporary", "0"],
                                 capture_output=True, text=True).stdout
        print("heaptrack:", "; ".join(line.strip() for line in summary.splitlines()[-3:]))
    if len(ends) > 3:  # a round's own figure swings with what the allocator keeps; the ends show the trend
        rest = (args.requests + WARMUP) * (len(ends) - 3)
        print(f"after the third round: {ends[2]} -> {ends[-1]} kB, {(ends[-1] - ends[2]) / rest:.1f} kB a request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
