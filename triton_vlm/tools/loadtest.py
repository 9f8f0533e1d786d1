"""`triton-vlm bench`: perf_analyzer load tests of the ensemble, one table per run; or NVIDIA's
genai-perf (`--tool genai-perf`), the LLM benchmark users already run against tensorrtllm_backend.

perf_analyzer 2.60 needs glibc 2.38; `scripts/perf_analyzer_runtime.sh` (run by `make setup`)
puts it and Debian trixie's C runtime under `.pa-runtime/`, and it runs through that loader.
Latency columns are perf_analyzer's request latency. It announces "using the first response"
for a decoupled model, yet on this ensemble its figures match the whole request (measured: first
tokens arrive after 50-100 ms). The per-model columns are the server's average request latency
per composing model; for the decoupled `llm` that covers accepting a request, not generating.

genai-perf 0.0.16 (`scripts/genai_perf_env.sh`, run by `make setup`, installs it in `.genai-perf/`:
its dependencies, pandas and transformers among them, stay out of the project environment) drives
perf_analyzer through the same runtime (a `perf_analyzer` wrapper first on its PATH) and counts
tokens with the checkpoint's own tokenizer. Endpoints: `kserve` (gRPC streaming, its tensorrtllm
inputs: `exclude_input_in_output`, `min_length`, ...), `generate` (HTTP `generate_stream`) and
`chat` / `multimodal` (an OpenAI-compatible server such as `triton-vlm openai`; `multimodal`
adds synthetic images as `data:` URLs).
"""
from __future__ import annotations

import base64
import csv
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from triton_vlm.families import DEFAULT_FAMILY, get_family
from triton_vlm.media import samples
from triton_vlm.server.tritonserver import PROJECT_ROOT

COMPOSING = ("preprocess", "vision_encoder", "llm")


def runtime_dir() -> Path:
    return Path(os.environ.get("TRITON_VLM_PA_RUNTIME", PROJECT_ROOT / ".pa-runtime"))


def genai_perf_dir() -> Path:
    return Path(os.environ.get("TRITON_VLM_GENAI_PERF", PROJECT_ROOT / ".genai-perf"))


def perf_analyzer_argv() -> list[str]:
    root = runtime_dir()
    loader, binary = root / "lib" / "ld-linux-x86-64.so.2", root / "bin" / "perf_analyzer"
    if not (loader.exists() and binary.exists()):
        raise FileNotFoundError(f"no perf_analyzer runtime in {root}: run `make setup`")
    return [str(loader), "--library-path", str(root / "lib"), str(binary)]


def request_kinds(family_name: str) -> dict[str, dict]:
    """perf_analyzer input data per request kind; media go as base64 text, which the server decodes."""
    family = get_family(family_name)
    image = base64.b64encode(samples.image_bytes(448, 448)).decode()
    video = base64.b64encode(samples.video_bytes(seconds=2.0, fps=10, width=320, height=240)).decode()
    text = "Describe what you see in a few words."
    return {
        "text": {"text_input": [text]},
        "image": {"text_input": [family.image_placeholder + text], "images": [image]},
        "video": {"text_input": [family.video_placeholder + text], "videos": [video]},
    }


def input_data(inputs: dict, max_tokens: int) -> dict:
    step = {name: {"content": values, "shape": [len(values)]} for name, values in inputs.items()}
    step["max_tokens"] = {"content": [max_tokens], "shape": [1]}
    step["stream"] = {"content": [True], "shape": [1]}
    return {"data": [step]}


@dataclass
class Row:
    kind: str
    concurrency: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    server_ms: dict[str, float] = field(default_factory=dict)  # composing model -> avg request latency


def parse_composing(stdout: str) -> dict[int, dict[str, float]]:
    """concurrency -> {model: server-side average request latency in ms}, from perf_analyzer's report."""
    result: dict[int, dict[str, float]] = {}
    blocks = re.split(r"^Request concurrency: (\d+)$", stdout, flags=re.M)
    for concurrency, block in zip(blocks[1::2], blocks[2::2]):
        models = re.findall(r"^\s+(\w+), version: \S+\n(?:.*\n)*?\s+Avg request latency: (\d+) usec", block, flags=re.M)
        result[int(concurrency)] = {name: int(usec) / 1000 for name, usec in models}
    return result


def run(url: str, kind: str, inputs: dict, concurrency: str, max_tokens: int, window_requests: int,
        workdir: Path) -> list[Row]:
    data, report = workdir / f"{kind}.json", workdir / f"{kind}.csv"
    data.write_text(json.dumps(input_data(inputs, max_tokens)))
    # A request without media does not call vision_encoder (the ensemble's skip_when_empty), and
    # perf_analyzer fails on a composing model that served nothing in its window.
    composing = [m for m in COMPOSING if m != "vision_encoder" or {"images", "videos"} & set(inputs)]
    argv = perf_analyzer_argv() + [
        "-m", "ensemble", "--bls-composing-models", ",".join(composing), "-i", "grpc", "--streaming", "-u", url,
        "--input-data", str(data),
        "--concurrency-range", concurrency, "--measurement-mode", "count_windows",
        "--measurement-request-count", str(window_requests), "--stability-percentage", "1000",
        "--max-trials", "3", "-f", str(report)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=workdir)
    if done.returncode != 0 or not report.exists():
        raise RuntimeError(f"perf_analyzer failed on {kind!r} (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    server_ms = parse_composing(done.stdout)
    rows = []
    with report.open() as f:
        for line in csv.DictReader(f):
            c = int(line["Concurrency"])
            rows.append(Row(kind, c, float(line["Inferences/Second"]), int(line["p50 latency"]) / 1000,
                            int(line["p99 latency"]) / 1000, server_ms.get(c, {})))
    return rows


def format_table(rows: list[Row]) -> str:
    head = ["kind", "concurrency", "req/s", "p50 ms", "p99 ms"] + [f"{m} ms" for m in COMPOSING]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.kind, str(r.concurrency), f"{r.requests_per_s:.2f}", f"{r.p50_ms:.0f}", f"{r.p99_ms:.0f}"]
        cells += [f"{r.server_ms[m]:.1f}" if m in r.server_ms else "-" for m in COMPOSING]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench(url: str, family: str = DEFAULT_FAMILY, kinds: tuple[str, ...] = ("text", "image", "video"),
          concurrency: str = "1:4:1", max_tokens: int = 16, window_requests: int = 8) -> list[Row]:
    available = request_kinds(family)
    unknown = set(kinds) - set(available)
    if unknown:
        raise ValueError(f"unknown request kinds {sorted(unknown)}; choose from {sorted(available)}")
    with tempfile.TemporaryDirectory(prefix="triton-vlm-bench-") as tmp:
        return [row for kind in kinds
                for row in run(url, kind, available[kind], concurrency, max_tokens, window_requests, Path(tmp))]


# genai-perf --endpoint-type and how its URL is formed, per `genai_perf` endpoint name.
GENAI_PERF_ENDPOINTS = {
    "kserve": ["--endpoint-type", "kserve", "--backend", "tensorrtllm"],
    "generate": ["--endpoint-type", "generate", "--endpoint", "v2/models/{model}/generate_stream"],
    "chat": ["--endpoint-type", "chat"],
    "multimodal": ["--endpoint-type", "multimodal"],  # OpenAI chat with synthetic images
}


@dataclass
class GenAIPerfRow:
    endpoint: str
    concurrency: int
    requests: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    latency_p50_ms: float


def genai_perf(url: str, endpoint: str, tokenizer: str | Path, *, model: str = "ensemble", concurrency: int = 1,
               requests: int = 8, input_tokens: int = 32, output_tokens: int = 16, image_size: int = 0,
               workdir: Path) -> GenAIPerfRow:
    """One genai-perf profile of `requests` streamed requests (after one warm-up) at `concurrency`:
    synthetic prompts of `input_tokens`, `output_tokens` asked for, and with `image_size` > 0 one
    synthetic image of that side per request (`multimodal` only)."""
    root = genai_perf_dir()
    binary, wrapper = root / "bin" / "genai-perf", root / "perf_analyzer" / "perf_analyzer"
    if not (binary.exists() and wrapper.exists()):
        raise FileNotFoundError(f"no genai-perf in {root}: run `make setup`")
    argv = [str(binary), "profile", "-m", model, "-u", url, "--streaming",
            *[a.format(model=model) for a in GENAI_PERF_ENDPOINTS[endpoint]],
            "--tokenizer", str(tokenizer), "--synthetic-input-tokens-mean", str(input_tokens),
            "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(output_tokens),
            "--concurrency", str(concurrency), "--request-count", str(requests), "--warmup-request-count", "1",
            "--artifact-dir", str(workdir / endpoint)]
    if image_size:
        argv += ["--image-width-mean", str(image_size), "--image-height-mean", str(image_size),
                 "--image-format", "png"]
    env = {**os.environ, "PATH": f"{wrapper.parent}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, cwd=workdir, env=env)
    exports = list((workdir / endpoint).glob("*/profile_export_genai_perf.json"))
    if done.returncode != 0 or not exports:
        raise RuntimeError(f"genai-perf failed on {endpoint!r} (exit {done.returncode}):\n"
                           f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    m = json.loads(exports[0].read_text())
    return GenAIPerfRow(endpoint, concurrency, int(m["request_count"]["avg"]), m["request_throughput"]["avg"],
                        m["output_token_throughput"]["avg"], m["time_to_first_token"]["p50"],
                        m["inter_token_latency"]["p50"], m["request_latency"]["p50"])


def format_genai_perf(rows: list[GenAIPerfRow]) -> str:
    head = ["endpoint", "concurrency", "requests", "req/s", "output tok/s", "TTFT p50 ms", "ITL p50 ms",
            "latency p50 ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r.endpoint} | {r.concurrency} | {r.requests} | {r.requests_per_s:.2f} | "
                     f"{r.output_tokens_per_s:.1f} | {r.ttft_p50_ms:.1f} | {r.itl_p50_ms:.1f} | {r.latency_p50_ms:.1f} |")
    return "\n".join(lines)
