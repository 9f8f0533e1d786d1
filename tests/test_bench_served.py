"""bench/served_gpu.py (issue #25's one GPU command) runs on the CPU in make test, at small sizes,
so that it cannot rot between the sessions that are lent a GPU: a real tritonserver built by
`triton-vlm build`, real gRPC streaming clients, the engine alone on the same prompt. The server
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
    subprocess.run([sys.executable, "bench/device_pack.py", "server", str(tmp_path / "carried" / "server"),
                    "--python", python, "--preset", "0"], cwd=ROOT, check=True, timeout=300)
    unpacked = tmp_path / "unpacked" / "pytriton" / "tritonserver"
    subprocess.run([sys.executable, "bench/served_gpu.py", "--carried", str(tmp_path / "carried"), "--unpack-to",
                    str(tmp_path / "unpacked"), "--device", "cpu", "--size", "tiny", "--concurrency",
                    ",".join(CONCURRENCY), "--rounds", "2", "--max-tokens", "16", "--distinct-images", "4",
                    "--video-size", "320x180", "--video-seconds", "2", "--video-repeats", "1", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    figures = json.loads((tmp_path / "served.json").read_text())
    assert figures["device"].startswith("cpu")
    assert figures["unpacked"] == {"server": str(unpacked)}  # and the stub found every library it needs
    check = figures["served"]["check"]
    assert len(check["output_ids"]) > 0 and check["responses"] >= 2  # streamed
    assert check["equals_engine_alone"], "the served greedy answer is not the engine's own"
    for side in (figures["served"]["image"], figures["engine_alone"]):
        assert set(side) == set(CONCURRENCY)
        for c, run in side.items():
            assert run["requests"] == 2 * int(c)
            assert run["output_tokens"] == 16 * run["requests"]  # min_tokens = max_tokens
            assert run["output_tokens_per_s"] > 0 and 0 < run["ttft_p50_ms"] <= run["ttft_p99_ms"]
    for run in figures["served"]["image"].values():  # every image request ran each unary step
        steps = run["step_compute_ms_per_request"]
        assert set(steps) == {"preprocess", "vision_encoder", "vision_encoder_batch"} and min(steps.values()) > 0
    assert set(figures["served_over_engine"]) == set(CONCURRENCY)
    video = figures["served"]["video"]
    assert video["measured"] and video["ttft_ms"] > 0 and len(video["ttft_cached_ms"]) == 1
    log = (tmp_path / "server.log").read_text()
    assert "Started GRPCInferenceService" in log and f'"backend-directory":"{unpacked / "backends"}"' in log
