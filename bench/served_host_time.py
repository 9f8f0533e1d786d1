"""The served path's own time to a first token, this tree against another in the same run (issue
#37): bench/served_gpu.py at concurrency 1, every request an image of its own, run on each tree in
turn (`--rounds` times, alternating, so that the machine's load falls on both alike), each run its
own build, server and engine of that tree's code.

    git archive BASE | tar -x -C /tmp/base
    HF_HUB_OFFLINE=1 .venv/bin/python bench/served_host_time.py --base /tmp/base --out DIR -- \\
        --device cpu --size small --rounds 8 --max-tokens 8 --video-seconds 1 --video-size 160x120

Per run: `host_ms` = served TTFT p50 - the engine alone's TTFT p50 on the same distinct prompts
(the issue's figure), and `outside_steps_ms` = that less the unary steps' compute per request
(preprocess and vision_encoder_batch, Triton's statistics): what the served path adds beyond the
work itself (queues, copies, hashing, calls between the steps). Medians over the rounds, and this
tree's over the base's. Writes `OUT/host_time.json` and each run's JSON under `OUT/`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def run(tree: Path, out: Path, bench_args: list[str]) -> dict:
    """One served_gpu.py run on `tree`'s code at concurrency 1: its figures. It runs in `tree`, whose
    package Triton's stubs then import (bench/other_tree.py)."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(BENCH / "served_gpu.py"), *bench_args, "--concurrency", "1", "--tree",
                    str(tree), "--results", str(out), "--out", str(out)], check=True, cwd=tree,
                   env={**os.environ, "TRITON_VLM_TREE_ROOT": str(tree)}, stdout=subprocess.DEVNULL)
    figures = json.loads((out / "served.json").read_text())
    served, alone = figures["served"]["image"]["1"], figures["engine_alone"]["1"]
    steps = served["step_stats"]
    compute = steps["preprocess"]["compute_ms_per_ensemble_request"] + \
        steps["vision_encoder_batch"]["compute_ms_per_ensemble_request"]
    host = served["ttft_p50_ms"] - alone["ttft_p50_ms"]
    return {"served_ttft_ms": served["ttft_p50_ms"], "engine_ttft_ms": alone["ttft_p50_ms"], "host_ms": round(host, 1),
            "steps_compute_ms": round(compute, 1), "outside_steps_ms": round(host - compute, 1),
            "front_own_ms": steps["vision_encoder"].get("own_ms_per_ensemble_request"),
            "equals_engine_alone": figures["served"]["check"]["equals_engine_alone"],
            "distinct_images": figures["distinct_images"], "distinct_prompts": figures["distinct_prompts"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other tree (a checkout or `git archive` of it)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each tree, alternating")
    ap.add_argument("--out", required=True)
    ap.add_argument("bench_args", nargs="*", help="after --: bench/served_gpu.py's arguments")
    args = ap.parse_args()
    trees = {"base": Path(args.base).resolve(), "this": BENCH.parent}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(run(tree, Path(args.out) / f"{name}-{r}", args.bench_args))
            print(name, r, runs[name][-1], flush=True)
    keys = ("served_ttft_ms", "engine_ttft_ms", "host_ms", "steps_compute_ms", "outside_steps_ms")
    medians = {name: {k: round(statistics.median(x[k] for x in got), 1) for k in keys} for name, got in runs.items()}
    figures = {"command": " ".join(sys.argv), "runs": runs, "median": medians,
               "this_over_base": {k: round(medians["this"][k] / medians["base"][k], 3) for k in ("host_ms",
                                                                                              "outside_steps_ms")}}
    (Path(args.out) / "host_time.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps({k: figures[k] for k in ("median", "this_over_base")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
