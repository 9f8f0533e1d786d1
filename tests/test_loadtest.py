"""`triton-vlm bench` drives the real perf_analyzer (through its glibc 2.38 runtime) against the session server."""
from __future__ import annotations

import subprocess
import sys


def test_bench_prints_a_table_with_the_split_per_composing_model(server):
    done = subprocess.run([sys.executable, "-m", "triton_vlm.tools.cli", "bench", "--url", server.grpc_url,
                           "--kinds", "text,image", "--concurrency", "1:2:1", "--max-tokens", "4",
                           "--window-requests", "4"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert {(r[0].strip(), r[1].strip()) for r in rows} == {("text", "1"), ("text", "2"), ("image", "1"), ("image", "2")}
    for row in rows:
        kind, _, rps, p50, p99, preprocess, encoder, llm = (c.strip() for c in row)
        assert float(rps) > 0 and 0 < float(p50) <= float(p99)
        assert all(float(ms) > 0 for ms in (preprocess, llm)), row
        # a request without media does not call the encoder
        assert (encoder == "-") if kind == "text" else float(encoder) > 0, row
