"""bench/served_gpu.py (issue #25's one GPU command) runs on the CPU in make test, at small sizes,
so that it cannot rot between the sessions that are lent a GPU: a real tritonserver built by
`triton-vlm build`, real gRPC streaming clients, an image of its own for every request, the engine
alone on the same distinct prompts, Triton's statistics with queue and compute apart. The server
is the one bench/device_pack.py packs for the device (for this Python), unpacked as there."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = ("1", "4")


def test_served_bench_on_cpu_with_the_packed_server(tmp_path):
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([sys.executable, "bench/device_pack.py", str(tmp_path / "carried"), "--server-only",
                    "--python", python, "--preset", "0"], cwd=ROOT, check=True, timeout=300)
    unpacked = tmp_path / "unpacked" / "pytriton" / "tritonserver"
    subprocess.run([sys.executable, "bench/served_gpu.py", "--carried", str(tmp_path / "carried" / "call1"),
                    "--unpack-to", str(tmp_path / "unpacked"), "--device", "cpu", "--size", "tiny", "--concurrency",
                    ",".join(CONCURRENCY), "--rounds", "2", "--max-tokens", "16", "--video-size", "320x180",
                    "--video-seconds", "2", "--video-repeats", "1", "--tree", "abc1234", "--results",
                    str(tmp_path / "results"), "--out", str(tmp_path)],
                   cwd=ROOT, check=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    figures = json.loads((tmp_path / "served.json").read_text())
    assert figures["device"].startswith("cpu")
    assert figures["unpacked"] == {"server": str(unpacked), "stub_cannot_find": []}
    check = figures["served"]["check"]
    assert len(check["output_ids"]) > 0 and check["responses"] >= 2  # streamed
    assert check["equals_engine_alone"], "the served greedy answer is not the engine's own"
    for side in (figures["served"]["image"], figures["engine_alone"]):
        assert set(side) == set(CONCURRENCY)
        for c, run in side.items():
            assert run["requests"] == 2 * int(c)
            assert run["output_tokens"] == 16 * run["requests"]  # min_tokens = max_tokens
            assert run["output_tokens_per_s"] > 0 and 0 < run["ttft_p50_ms"] <= run["ttft_p99_ms"]
    requests = sum(2 * int(c) for c in CONCURRENCY)
    # every image request its own image, the engine alone the same distinct prompts
    assert figures["image_requests"] == figures["distinct_images"] == figures["distinct_prompts"] == requests
    for c, run in figures["served"]["image"].items():  # every image request ran each unary step
        assert run["encoder_cache_hits"] == 0, c
        steps = run["step_stats"]
        assert set(steps) == {"preprocess", "vision_encoder", "vision_encoder_batch"}
        for name, step in steps.items():
            assert step["requests"] >= run["requests"] and step["executions"] >= 1, name
            assert step["mean_batch_requests"] == round(step["requests"] / step["executions"], 2)
            assert step["compute_ms_per_execution"] > 0 and step["compute_ms_per_request"] > 0
            assert step["queue_ms_per_request"] >= 0 and step["compute_ms_per_ensemble_request"] > 0
        batch = steps["vision_encoder_batch"]
        assert batch["mean_batch_rows"] > 1  # patch rows an execution
        # Triton charges every request of an execution its whole time: summed per request it is at
        # least the executions' own time
        assert batch["compute_ms_per_request"] * batch["requests"] >= 0.99 * (
            batch["compute_ms_per_execution"] * batch["executions"])
        assert "own_ms_per_ensemble_request" in steps["vision_encoder"]
    assert set(figures["served_minus_engine_ttft_ms"]) == set(CONCURRENCY)
    assert set(figures["served_over_engine"]) == set(CONCURRENCY)
    video = figures["served"]["video"]
    assert video["measured"] and video["ttft_ms"] > 0 and len(video["ttft_cached_ms"]) == 1
    kept = list((tmp_path / "results").glob("served-tiny-cpu-*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == figures
    assert figures["tree"] == "abc1234" and "bench/served_gpu.py" in figures["command"]
    log = (tmp_path / "server.log").read_text()
    assert "Started GRPCInferenceService" in log and f'"backend-directory":"{unpacked / "backends"}"' in log
    # bench/plots.py draws the kept run: throughput and TTFT against concurrency, served and engine alone
    drawn = subprocess.run([sys.executable, "bench/plots.py", "--results", str(tmp_path / "results"), "--out",
                            str(tmp_path / "figures")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0, drawn.stderr
    svg = (tmp_path / "figures" / f"{kept[0].stem}.svg").read_text()
    assert all(text in svg for text in ("output tokens/s", "time to first token", "llm engine alone", "served"))
