"""The whole ensemble served by tritonserver, measured end to end with real clients (issue #25), and
the same prompts through the llm engine alone in the same run: one command, one device call.

    python3 bench/served_gpu.py --device gpu --results "$OUT" --out "$OUT"      # a lent GPU (bench/device_pack.py)
    HF_HUB_OFFLINE=1 .venv/bin/python bench/served_gpu.py --device cpu --size small \
        --concurrency 1,4 --rounds 2 --video-size 320x180 --video-seconds 2 --out DIR   # the CPU

Steps: a random-weight Qwen2.5-VL checkpoint (`--size 7b`: the 7B's text stack, bench/decoder.py
`--decoder-7b`, and its vision tower, bench/gpu.py's VISION_7B, bfloat16; `tiny`/`small`: the
demo sizes); `triton-vlm build --device D` (on a GPU `--encoder-backend torch`); the bundled
tritonserver started on free ports; one streamed answer checked; then, over gRPC streaming
(`triton_vlm.clients.client.stream_generate`, asyncio: one client thread drives every stream), image
requests, every one with a 1280x720 JPEG (`--image-size`) of its own, so that neither the encoder's
cache nor the llm's prefix cache answers, and a short prompt, `--max-tokens` output tokens each
(`min_tokens` the same): at each concurrency, that many requests in flight at a time, `--rounds`
each (a closed loop), TTFT p50 / p99, output tokens/s, and Triton's statistics of the unary steps
(`step_stats`: queue and compute apart, per request, per execution and per ensemble request, with
the mean batch); one video request (`--video-seconds` s at `--video-size`, 30 fps), its TTFT, and
that of the same video again (`--video-repeats`: the one case that measures the encoder's cache);
PyAV is needed on both sides (without it the video is reported as not measured). Then the llm's
inputs of every one of those image requests, as the served preprocess and vision_encoder make them
(input ids, embeddings, positions); the server stopped, the llm's own engine is built from the
repository's llm config and given those same distinct prompts at the same concurrencies:
`served_over_engine` is the ratio of output tokens/s, `served_minus_engine_ttft_ms` the served
path's own time to a first token (c=1: the host's time around the steps, and the steps' compute).
The JSON says how many distinct images the served side sent (`distinct_images`) and how many
distinct prompts the engine alone ran (`distinct_prompts`).

Writes `OUT/served.json`, the server's log `OUT/server.log`, and the same JSON (with the device, the
tree and the command) as `RESULTS/served-SIZE-DEVICE-DATE.json` (`--results`, default bench/results).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH = Path(__file__).resolve().parent
# the tree whose triton_vlm is measured (bench/served_host_time.py measures another one's with this bench)
TREE_ENV = "TRITON_VLM_TREE_ROOT"
ROOT = Path(os.environ.get(TREE_ENV) or BENCH.parent).resolve()
sys.path[:0] = [str(ROOT), str(BENCH)]
import other_tree  # noqa: E402

other_tree.install(ROOT)

from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL  # noqa: E402

PROMPT = f"<|im_start|>user\n{QWEN2_5_VL.image_placeholder}Describe the picture.<|im_end|>\n<|im_start|>assistant\n"
VIDEO_PROMPT = f"<|im_start|>user\n{QWEN2_5_VL.video_placeholder}What happens?<|im_end|>\n<|im_start|>assistant\n"


def write_checkpoint(size: str, out: Path, device: str) -> Path:
    from triton_vlm.families.demo import write_demo_checkpoint

    if size != "7b":
        return write_demo_checkpoint("qwen2_5_vl", out, size)
    import torch
    from decoder import DECODER_7B, decoder_7b_overrides
    from gpu import VISION_7B

    overrides = decoder_7b_overrides(DECODER_7B["num_hidden_layers"], DECODER_7B["hidden_size"], torch.bfloat16,
                                     torch.device("cuda" if device == "gpu" else "cpu"))
    return write_demo_checkpoint("qwen2_5_vl", out, "small", overrides={**overrides, "vision": VISION_7B})


def load_figures(requests: int, tokens: int, seconds: float, ttfts: list[float]) -> dict:
    """One concurrency's figures, the served side's and the engine's alike."""
    p50, p99 = np.percentile(ttfts, [50, 99]) if ttfts else (float("nan"),) * 2
    return {"requests": requests, "output_tokens": tokens, "seconds": round(seconds, 3),
            "output_tokens_per_s": round(tokens / seconds, 1), "ttft_p50_ms": round(1e3 * p50, 1),
            "ttft_p99_ms": round(1e3 * p99, 1)}


async def closed_loop(one: Callable[[int], Awaitable[tuple[float, int]]], concurrency: int, rounds: int) -> dict:
    """`concurrency` workers, `rounds` requests each, one after the other: `one(i)` sends request i
    and returns its time to first token and its output tokens."""
    ttfts: list[float] = []
    tokens = 0

    async def worker(w: int) -> None:
        nonlocal tokens
        for r in range(rounds):
            ttft, n = await one(w * rounds + r)
            ttfts.append(ttft)
            tokens += n

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return load_figures(concurrency * rounds, tokens, time.perf_counter() - start, ttfts)


def served_one(channel, values_of: Callable[[int], dict]) -> Callable[[int], Awaitable[tuple[float, int]]]:
    from triton_vlm.clients.client import stream_generate

    async def one(i: int) -> tuple[float, int]:
        start, first, n = time.perf_counter(), None, 0
        async for increment in stream_generate(channel, values_of(i), f"bench-{i}"):
            if increment.output_ids and first is None:
                first = time.perf_counter() - start
            n += len(increment.output_ids)
        return first if first is not None else float("nan"), n
    return one


def request(prompt: str, max_tokens: int, images=(), videos=()) -> dict:
    from triton_vlm.clients.client import request_values

    return request_values(prompt, images, videos, max_tokens=max_tokens, min_tokens=max_tokens)


def step_outputs(url: str, values: dict) -> tuple[dict, dict[str, str]]:
    """The llm's inputs for `values` as the served steps before it make them (the ensemble's step
    list, read from its config), and the llm's parameters."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    from triton_vlm.clients.client import grpc_inputs

    with grpcclient.InferenceServerClient(url) as client:
        params = lambda model: {k: v["string_value"] for k, v in  # noqa: E731
                                client.get_model_config(model, as_json=True)["config"]["parameters"].items()}
        steps = json.loads(params("ensemble")["steps"])
        tensors = {name: value for name, (value, _) in values.items()}
        for step in steps[:-1]:
            given = {n: tensors[n] for n in step["inputs"] if n in tensors}
            skip = given.get(step.get("skip_when_empty", ""))
            if skip is not None and skip.size == 0:
                continue
            inputs = grpc_inputs({name: (array, np_to_triton_dtype(array.dtype)) for name, array in given.items()})
            result = client.infer(step["model"], inputs, outputs=[grpcclient.InferRequestedOutput(n)
                                                                   for n in step["outputs"]])
            tensors.update({n: a for n in step["outputs"] if (a := result.as_numpy(n)) is not None})
        return tensors, params(steps[-1]["model"])


def engine_prompt(tensors: dict) -> dict:
    """`Engine.submit`'s prompt keywords from the llm's inputs (`step_outputs`)."""
    return {"input_ids": tensors["input_ids"], "embeddings": tensors.get("embeddings"),
            "mrope_position_ids": tensors["mrope_position_ids"],
            "mrope_position_delta": int(tensors["mrope_position_delta"].reshape(-1)[0]),
            "media_position_ids": tensors.get("media_position_ids"), "kept_rows": tensors.get("kept_rows")}


def engine_prompts(url: str, images: list[bytes], max_tokens: int) -> list[dict]:
    """The engine's prompt of each image's request, as the served steps make it (four at a time)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        made = list(pool.map(lambda image: step_outputs(url, request(PROMPT, max_tokens, [image])), images))
    return [engine_prompt(tensors) for tensors, _ in made]


def distinct(values: list) -> int:
    """How many of `values` (bytes, or dicts of arrays) differ."""
    import hashlib

    def key(value) -> bytes:
        if isinstance(value, bytes):
            return hashlib.sha256(value).digest()
        digest = hashlib.sha256()
        for name in sorted(value):
            if value[name] is not None:
                digest.update(name.encode() + np.ascontiguousarray(value[name]).tobytes())
        return digest.digest()
    return len({key(v) for v in values})


def engine_alone(repo: Path, params: dict[str, str], check: dict, prompts: dict[str, list[dict]], max_tokens: int
                 ) -> tuple[dict, list[int]]:
    """The llm's engine as the served llm builds it, at each concurrency the prompts of that
    concurrency's served requests (bench/decoder.py's closed loop); and the greedy tokens of the
    check's prompt with `max_tokens` alone (no `min_tokens`), as the check's."""
    import dataclasses
    import threading

    from decoder import run_engine

    from triton_vlm.contract.params import LLMOptions
    from triton_vlm.llm import Engine, SamplingParams

    engine = Engine(repo / "llm" / "1" / params["checkpoint"], **dataclasses.asdict(LLMOptions.from_params(params)))
    try:
        tokens, done = [], threading.Event()  # also the warm-up

        def emit(out) -> None:
            tokens.extend(out.token_ids)
            if out.finish_reason is not None:
                done.set()
        engine.submit("check", **check, params=SamplingParams(max_tokens=max_tokens), emit=emit)
        done.wait()
        runs = {}
        for c, own in prompts.items():
            run = run_engine(engine, own, max_tokens, int(c), min_tokens=max_tokens)
            runs[c] = load_figures(len(own), run.tokens, run.seconds, run.ttfts)
        return runs, tokens
    finally:
        engine.shutdown()


def measure_served(server, args, check_image: bytes, images: dict[str, list[bytes]]) -> dict:
    """The check request, then each concurrency's image requests (`images[c]`: one image a request)
    with the unary steps' statistics, then the video."""
    import step_stats

    from triton_vlm.clients.client import aio_channel, generate

    check = generate(server.grpc_url, PROMPT, [check_image], max_tokens=args.max_tokens, stream=True, timeout=300)
    if len(check.output_ids) == 0 or check.responses < 2:
        raise SystemExit(f"the check request streamed {check.responses} responses, {len(check.output_ids)} tokens")
    out: dict = {"check": {"output_ids": check.output_ids, "responses": check.responses,
                           "ttft_ms": round(1e3 * check.time_to_first_token, 1)}, "image": {}}

    async def run() -> None:
        channel = aio_channel(server.grpc_url)
        try:
            for c, own in images.items():
                one = served_one(channel, lambda i: request(PROMPT, args.max_tokens, [own[i]]))  # noqa: B023
                before, hits = step_stats.read(server.grpc_url), cache_hits(server.metrics_url)
                out["image"][c] = run = await closed_loop(one, int(c), args.rounds)
                run["step_stats"] = step_stats.figures(before, step_stats.read(server.grpc_url), run["requests"])
                run["encoder_cache_hits"] = cache_hits(server.metrics_url) - hits
            out["video"] = await video_ttft(channel, args)
        finally:
            await channel.close()
    asyncio.run(run())
    return out


def cache_hits(metrics_url: str) -> int:
    """The encoder's cache hits so far (`triton_vlm_encoder_cache_hits`, every instance)."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return int(sum(float(line.split()[-1]) for line in lines if line.startswith("triton_vlm_encoder_cache_hits{")))


async def video_ttft(channel, args) -> dict:
    try:
        from triton_vlm.media import samples

        width, height = (int(v) for v in args.video_size.split("x"))
        video = samples.video_bytes(args.video_seconds, 30, width, height)
    except ImportError as error:
        return {"measured": False, "why": f"PyAV is not installed here ({error})"}
    one = served_one(channel, lambda i: request(VIDEO_PROMPT, args.max_tokens, videos=[video]))
    ttfts = [(await one(i))[0] for i in range(1 + args.video_repeats)]
    # the first is the video's own; the encoder's cache answers the repeats (the same video)
    return {"measured": True, "size": args.video_size, "seconds": args.video_seconds, "fps": 30,
            "ttft_ms": round(1e3 * ttfts[0], 1), "ttft_cached_ms": [round(1e3 * t, 1) for t in ttfts[1:]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--size", choices=("7b", "small", "tiny"), default="7b")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=2, help="requests per concurrent client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--image-size", default="1280x720")
    ap.add_argument("--video-size", default="1280x720")
    ap.add_argument("--video-seconds", type=float, default=10.0)
    ap.add_argument("--video-repeats", type=int, default=2, help="the same video again (the encoder's cache)")
    ap.add_argument("--carried", help="a folder bench/device_pack.py packed (call1): its server unpacked and used")
    ap.add_argument("--unpack-to", default="/tmp/triton-vlm-carried")
    ap.add_argument("--tree", help="the tree measured, where git cannot tell (a copy without .git)")
    ap.add_argument("--results", default=str(BENCH / "results"), help="where the run's JSON is kept")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    unpacked = {}
    if args.carried:  # as call 1 of bench/device_session.py unpacks it
        from device_pack import SERVER_ARCHIVE, unpack_server

        root, missing = unpack_server(Path(args.carried) / SERVER_ARCHIVE, Path(args.unpack_to))
        os.environ["TRITON_VLM_TRITON_ROOT"] = str(root)
        unpacked = {"server": str(root), "stub_cannot_find": missing}
    from triton_vlm.media import samples
    from triton_vlm.server.tritonserver import TritonServer

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    concurrencies = [c.strip() for c in args.concurrency.split(",")]
    import torch
    from decoder import device_name

    started = time.perf_counter()
    now = datetime.datetime.now()
    figures: dict = {"device": f"{device_name(torch.device('cuda' if args.device == 'gpu' else 'cpu'))}, "
                               f"torch {torch.__version__}", "date": now.isoformat(timespec="seconds"),
                     "tree": args.tree or tree(), "command": command(argv), "size": args.size,
                     "max_tokens": args.max_tokens, "rounds": args.rounds, "image_size": args.image_size,
                     "unpacked": unpacked, "timings_s": {}}
    # one image a request: the check's, then each concurrency's requests' own
    width, height = (int(v) for v in args.image_size.split("x"))
    counts = {c: int(c) * args.rounds for c in concurrencies}
    seeds = iter(range(1 + sum(counts.values())))
    check_image = samples.image_bytes(width, height, seed=float(next(seeds)))
    images = {c: [samples.image_bytes(width, height, seed=float(next(seeds))) for _ in range(n)]
              for c, n in counts.items()}
    figures["image_requests"] = sum(counts.values())
    figures["distinct_images"] = distinct([image for own in images.values() for image in own])
    with tempfile.TemporaryDirectory(prefix="served-gpu-") as tmp:
        checkpoint = write_checkpoint(args.size, Path(tmp) / "ckpt", args.device)
        figures["timings_s"]["checkpoint"] = round(time.perf_counter() - started, 1)
        repo = Path(tmp) / "repository"
        build = [sys.executable, "-m", other_tree.cli_module(ROOT), "build", "--checkpoint", str(checkpoint), "--repo",
                 str(repo), "--device", args.device] + (["--encoder-backend", "torch"] if args.device == "gpu" else [])
        subprocess.run(build, check=True, cwd=ROOT)
        figures["build"] = " ".join(build[3:])
        figures["timings_s"]["build"] = round(time.perf_counter() - started, 1)
        with TritonServer(repo, log_file=out_dir / "server.log") as server:
            figures["timings_s"]["server_ready"] = round(time.perf_counter() - started, 1)
            figures["served"] = measure_served(server, args, check_image, images)
            figures["timings_s"]["served"] = round(time.perf_counter() - started, 1)
            check, llm_params = step_outputs(server.grpc_url, request(PROMPT, args.max_tokens, [check_image]))
            prompts = {c: engine_prompts(server.grpc_url, own, args.max_tokens) for c, own in images.items()}
        figures["timings_s"]["engine_prompts"] = round(time.perf_counter() - started, 1)
        figures["prompt_tokens"] = int(check["input_ids"].size)
        figures["distinct_prompts"] = distinct([prompt for own in prompts.values() for prompt in own])
        figures["engine_alone"], tokens = engine_alone(repo, llm_params, engine_prompt(check), prompts,
                                                       args.max_tokens)
    # the served answer (greedy) is the engine's own for the same prompt
    figures["served"]["check"]["equals_engine_alone"] = figures["served"]["check"]["output_ids"] == tokens
    served, alone = figures["served"]["image"], figures["engine_alone"]
    figures["served_over_engine"] = {c: round(served[c]["output_tokens_per_s"] / alone[c]["output_tokens_per_s"], 3)
                                     for c in alone}
    figures["served_minus_engine_ttft_ms"] = {c: round(served[c]["ttft_p50_ms"] - alone[c]["ttft_p50_ms"], 1)
                                              for c in alone}
    figures["timings_s"]["total"] = round(time.perf_counter() - started, 1)
    text = json.dumps(figures, indent=1)
    (out_dir / "served.json").write_text(text)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    kept = results / f"served-{args.size}-{slug(figures['device'].split(',')[0])}-{now:%Y%m%d-%H%M%S}.json"
    kept.write_text(text)
    print(text)
    print(f"kept as {kept}")
    return 0


def slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text.lower()).strip("-").replace("--", "-")


def command(argv: list[str] | None) -> str:
    """This run's command line."""
    import shlex

    return shlex.join([Path(sys.executable).name, "bench/served_gpu.py", *(sys.argv[1:] if argv is None else argv)])


def tree() -> str:
    """The commit measured, `-dirty` when the tree has changes of its own."""
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=BENCH, capture_output=True, text=True,  # noqa: E731
                                        check=True).stdout.strip()
        if ROOT != BENCH.parent:
            return f"the tree at {ROOT}"
        return git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "-uno") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
