"""Where the llm engine's time goes at concurrency N: every step's kind (a CUDA graph replay or an
eager pass), its rows and its wall time, for N prompts submitted at once, three times over (the
first run meets every prompt shape for the first time; the next two repeat them).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/llm_steps.py --device cuda [--requests 16] [--max-tokens 64]

The prompts are bench/decoder.py's (chat prompts of 16 lengths) on the family's `small` demo
checkpoint. Per run it prints the wall time, the median time to first token, and per step kind the
steps, their forward time (synchronised) and rows, then the first steps one by one.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402

from decoder import prompts, sync  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen2_5_vl")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--dtype", help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    from triton_vlm.families.demo import write_demo_checkpoint
    from triton_vlm.llm import Engine, SamplingParams

    device = torch.device(args.device)
    ckpt = write_demo_checkpoint(args.family, Path(tempfile.mkdtemp()) / "small", "small")
    engine = Engine(ckpt, device=args.device, dtype=args.dtype or ("float32" if device.type == "cpu" else "bfloat16"),
                    max_running=max(16, args.requests), kv_cache_tokens=args.requests * (600 + args.max_tokens))
    chat_template = (ckpt / "chat_template.jinja").read_text()
    inputs = [engine.tokenizer.encode(p, add_special_tokens=False).ids
              for p in prompts(args.requests, chat_template)]
    steps: list[tuple[str, int, float]] = []
    forward = engine.runner.forward

    def timed_forward(chunks):
        graphs = engine.runner.graphs
        kind = "graph" if graphs is not None and graphs.takes(chunks) else "eager"
        sync(device)
        start = time.perf_counter()
        logits = forward(chunks)
        sync(device)
        steps.append((kind, sum(c.num_tokens for c in chunks), time.perf_counter() - start))
        return logits

    engine.runner.forward = timed_forward
    for run in ("first (new shapes)", "again", "again"):
        steps.clear()
        first: dict[int, float] = {}
        ends: list[float] = []
        start = time.perf_counter()
        for i, ids in enumerate(inputs):
            def emit(out, i=i):
                first.setdefault(i, time.perf_counter() - start)
                if out.finish_reason is not None:
                    ends.append(time.perf_counter() - start)
            engine.submit(f"{run}-{i}-{time.monotonic_ns()}", ids, None, None, None,
                          SamplingParams(max_tokens=args.max_tokens), emit)
        while len(ends) < len(inputs):
            time.sleep(0.005)
        print(f"{run}: wall {max(ends) * 1000:.0f} ms, {len(steps)} steps, "
              f"TTFT median {statistics.median(first.values()) * 1000:.0f} ms")
        by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
        for kind, rows, seconds in steps:
            by_kind[kind][0] += 1
            by_kind[kind][1] += seconds
            by_kind[kind][2] += rows
        for kind, (n, seconds, rows) in by_kind.items():
            print(f"   {kind}: {n} steps, forward {seconds * 1000:.0f} ms ({seconds / n * 1000:.2f} per step), {rows} rows")
        print("   first steps (kind, rows, ms):", [(k, r, round(s * 1000, 1)) for k, r, s in steps[:10]])
    engine.shutdown()


if __name__ == "__main__":
    main()
