"""NVIDIA's genai-perf (0.0.16, installed by `make setup` in `.genai-perf/`) against the real server:
the runs users already make against tensorrtllm_backend deployments complete and report their
request counts and token rates. Each run is bounded: one warm-up and a few streamed requests of
short synthetic prompts, counted with the checkpoint's own tokenizer."""
from __future__ import annotations

import pytest

from triton_vlm.tools.loadtest import GenAIPerfRow, format_genai_perf, genai_perf

REQUESTS = 6


def check(row: GenAIPerfRow) -> None:
    """Every request answered, and real rates measured from streamed tokens."""
    print("\n" + format_genai_perf([row]))
    assert row.requests == REQUESTS
    assert row.requests_per_s > 0 and row.output_tokens_per_s > 0
    assert 0 < row.ttft_p50_ms <= row.latency_p50_ms
    assert row.itl_p50_ms > 0  # more than one response per request: tokens were streamed


@pytest.mark.parametrize("endpoint", ["kserve", "generate"])
def test_genai_perf_against_the_ensemble(server, tiny_checkpoint, endpoint, tmp_path):
    """`kserve`: gRPC streaming with tensorrtllm_backend's inputs (`--backend tensorrtllm`: it sends
    `exclude_input_in_output`, `stream`, `max_tokens`, and `min_length` for a fixed output length);
    `generate`: Triton's HTTP `generate_stream`."""
    url = server.grpc_url if endpoint == "kserve" else server.http_url
    check(genai_perf(url, endpoint, tiny_checkpoint, requests=REQUESTS, output_tokens=8, workdir=tmp_path))


def test_bench_command_prints_genai_perfs_table(server, tiny_checkpoint):
    """`triton-vlm bench --tool genai-perf` on both ensemble endpoints: one row each, rates filled."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "triton_vlm.tools.cli", "bench", "--tool", "genai-perf", "--url",
                           server.grpc_url, "--http-url", server.http_url, "--tokenizer", str(tiny_checkpoint),
                           "--concurrency", "1", "--max-tokens", "8", "--window-requests", str(REQUESTS)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert [(r[0], r[1], r[2]) for r in rows] == [("kserve", "1", str(REQUESTS)), ("generate", "1", str(REQUESTS))]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 and float(r[5]) > 0 for r in rows), rows
