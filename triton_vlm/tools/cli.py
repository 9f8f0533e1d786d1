"""The `triton-vlm` console script (commands of shared/INTERFACE.md)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from triton_vlm.server.admin import ADMIN_HEADER, ADMIN_KEY_ENV
from triton_vlm.server.tritonserver import ANY_HOST

if TYPE_CHECKING:
    from triton_vlm.repository.options import BuildOptions


def _demo_checkpoint(args) -> int:
    from triton_vlm.families.demo import write_demo_checkpoint

    out = write_demo_checkpoint(args.family, args.out, args.size, seed=args.seed)
    print(f"wrote {args.family} ({args.size}) checkpoint to {out}")
    return 0


# BuildOptions fields without a flag of their own name: each limit has one (triton_vlm.contract.limits),
# the cache sizes are asked in MiB.
_DERIVED = ("limits", "encoder_cache_bytes", "kv_cache_bytes")


def build_options(args: argparse.Namespace) -> BuildOptions:
    """The BuildOptions of parsed `build` arguments: every other field has a flag of its own name."""
    from triton_vlm.contract.limits import Limits
    from triton_vlm.repository.options import BuildOptions

    given = vars(args)
    limits = Limits.from_params({k: str(v) for k, v in given.items() if v is not None})
    return BuildOptions(**{f.name: given[f.name] for f in dataclasses.fields(BuildOptions) if f.name not in _DERIVED},
                        limits=limits, encoder_cache_bytes=args.encoder_cache_mb << 20,
                        kv_cache_bytes=args.kv_cache_mb << 20)


def _build(args) -> int:
    from triton_vlm.repository.build import build_repository

    repo = build_repository(args.checkpoint, args.repo, build_options(args),
                            report=lambda line: print(f"build: {line}"))
    print(f"built model repository {repo}")
    return 0


def _serve(args) -> int:
    from triton_vlm.server.stub_python import check_stub_numpy
    from triton_vlm.server.tritonserver import ServerError, TritonServer, server_env

    try:
        check_stub_numpy(server_env())
    except ServerError as error:  # a server that would load and then fail every request
        print(f"triton-vlm serve: {error}", file=sys.stderr)
        return 2
    try:
        server = TritonServer(args.repo, args.http_port, args.grpc_port, args.metrics_port, echo=True, supervise=True,
                              admin_key=args.admin_key or None, host=args.host)
    except ValueError as error:  # the key's rule, never the key
        print(f"triton-vlm serve: --admin-key: {error}", file=sys.stderr)
        return 2
    stopping = []

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        server.forward_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        server.start(timeout=args.timeout)
    except ServerError as error:
        if stopping:  # asked to stop while starting: not a failure
            return 0
        print(f"triton-vlm serve: {error}", file=sys.stderr)
        return 1
    if stopping:  # a signal came while the server was starting
        server.forward_signal(stopping[0])
    else:
        print(f"ready: {server.bound()}; shared-memory, "
              f"model-repository, trace and logging APIs " + (f"need the header {ADMIN_HEADER}: <--admin-key>"
                                                               if args.admin_key else "closed (no --admin-key)"),
              file=sys.stderr)
    code = server.wait()
    if stopping:
        return 0
    print(f"triton-vlm serve: tritonserver exited with code {code}:\n{server.errors()}", file=sys.stderr)
    return code or 1


def _chat_prompt(args) -> str:
    """`--prompt` as one user turn (the media first) through the chat template of `--checkpoint`,
    else of the server (its `ensemble` config's `chat_template`, the family its `preprocess`'s)."""
    from triton_vlm.clients.chat import load_chat_template, user_prompt
    from triton_vlm.families import detect_family, get_family

    if args.checkpoint:
        template, family = load_chat_template(args.checkpoint), detect_family(args.checkpoint)
    else:
        import tritonclient.grpc as grpcclient

        with grpcclient.InferenceServerClient(args.url) as client:
            template = client.get_model_config("ensemble").config.parameters["chat_template"].string_value
            family = get_family(client.get_model_config("preprocess").config.parameters["family"].string_value)
    if not template:
        raise ValueError(f"no chat template in {args.checkpoint or 'the server ensemble config'}; "
                         "send the prompt as is with --raw-prompt")
    return user_prompt(template, family, args.prompt, len(args.image), len(args.video))


def _infer(args) -> int:
    from tritonclient.utils import InferenceServerException

    from triton_vlm.clients.client import RequestError, generate

    images = [Path(p).read_bytes() for p in args.image]
    videos = [Path(p).read_bytes() for p in args.video]
    on_text = (lambda text: print(text, end="", flush=True)) if args.stream and not args.json else None
    try:
        prompt = args.prompt if args.raw_prompt else _chat_prompt(args)
    except (ValueError, InferenceServerException) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        result = generate(args.url, prompt, images, videos, on_text=on_text, max_tokens=args.max_tokens,
                          stream=args.stream, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          seed=args.seed, stop_words=args.stop, repetition_penalty=args.repetition_penalty,
                          mm_options=json.loads(args.mm_options) if args.mm_options else None)
    except RequestError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"text": result.text, "output_ids": result.output_ids, "finish_reason": result.finish_reason,
                          "tokens": len(result.output_ids), "time_to_first_token_s": result.time_to_first_token,
                          "total_s": result.total_time}))
    else:
        if not args.stream:
            print(result.text, end="")
        print(f"\n[{len(result.output_ids)} tokens, finish_reason={result.finish_reason}, "
              f"time to first token {result.time_to_first_token or 0:.3f} s, total {result.total_time:.3f} s]",
              file=sys.stderr)
    return 0


def _openai(args) -> int:
    from triton_vlm.clients.openai_server import serve

    serve(args.url, args.checkpoint, args.host, args.port, args.model_name, args.max_tokens)
    return 0


def _bench(args) -> int:
    import tempfile

    from triton_vlm.server.tritonserver import TritonServer
    from triton_vlm.tools import loadtest

    def measure(grpc_url: str, http_url: str | None, tokenizer: str | None) -> str:
        if args.tool == "perf_analyzer":
            return loadtest.format_table(loadtest.bench(grpc_url, args.family, tuple(args.kinds.split(",")),
                                                        args.concurrency, args.max_tokens, args.window_requests))
        if not tokenizer:
            raise SystemExit("--tool genai-perf needs --tokenizer (the checkpoint) with --url")
        urls = {"kserve": grpc_url, "generate": http_url, "chat": args.openai_url, "multimodal": args.openai_url}
        rows = []
        with tempfile.TemporaryDirectory(prefix="triton-vlm-genai-perf-") as tmp:
            for endpoint in args.endpoints.split(","):
                if not urls.get(endpoint):
                    raise SystemExit(f"genai-perf endpoint {endpoint!r} needs its URL (--http-url, --openai-url)")
                for concurrency in sorted({int(c) for c in args.concurrency.split(":")[:2]}):
                    rows.append(loadtest.genai_perf(urls[endpoint], endpoint, tokenizer, concurrency=concurrency,
                                                    requests=args.window_requests, output_tokens=args.max_tokens,
                                                    image_size=args.image_size if endpoint == "multimodal" else 0,
                                                    workdir=Path(tmp)))
        return loadtest.format_genai_perf(rows)

    if args.repo:
        from triton_vlm.repository.options import CHECKPOINT_DIR

        with TritonServer(args.repo) as server:
            table = measure(server.grpc_url, server.http_url,
                            args.tokenizer or str(Path(args.repo) / "preprocess" / "1" / CHECKPOINT_DIR))
    else:
        table = measure(args.url, args.http_url, args.tokenizer)
    print(table)
    return 0


def _demo(args) -> int:
    from triton_vlm.tools.demo import run_demo

    return run_demo(Path(args.workdir), size=args.size, family_name=args.family)


def parser() -> argparse.ArgumentParser:
    from triton_vlm.contract.limits import Limits
    from triton_vlm.families import DEFAULT_FAMILY, FAMILIES
    from triton_vlm.repository.options import BuildOptions
    from triton_vlm.vision.runtime.backends import BACKENDS
    from triton_vlm.vision.runtime.tensorrt_engine import PRECISIONS

    p = argparse.ArgumentParser(prog="triton-vlm", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("demo-checkpoint", help="write a random-weight checkpoint that transformers loads offline")
    c.add_argument("--family", required=True, choices=FAMILIES)
    c.add_argument("--out", required=True)
    c.add_argument("--size", choices=("tiny", "small"), default="tiny")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(run=_demo_checkpoint)

    c = sub.add_parser("build", help="build a Triton model repository from a local checkpoint")
    c.add_argument("--checkpoint", required=True)
    c.add_argument("--repo", required=True)
    defaults = BuildOptions()

    def option(name: str, help: str | None = None, **kwargs) -> None:
        """The flag of BuildOptions field `name`, its default the field's."""
        default = getattr(defaults, name)
        if "action" not in kwargs:
            kwargs.setdefault("type", type(default))
        c.add_argument("--" + name.replace("_", "-"), default=default, help=help, **kwargs)

    option("device", choices=("cpu", "gpu"), help="gpu: llm and vision_encoder_batch on GPU instances, "
           "preprocess and ensemble on the CPU")
    option("gpus", "--device gpu: GPUs of the llm and encoder instances, e.g. 0,1 (default: every GPU visible "
           "at build time; 0 when none is, e.g. building on a machine without CUDA)")
    option("preprocess_instances", "0: half the cores on a GPU build (2 to 16), else 2")
    for limit in dataclasses.fields(Limits):  # preprocess request limits, defaults in triton_vlm.contract.limits
        c.add_argument("--" + limit.name.replace("_", "-"), type=float if limit.type == "float" else int,
                       metavar="N", help=f"preprocess limit (default {limit.default})")
    option("encoder_threads", "ONNX Runtime threads; 0: cores / encoder instances")
    option("encoder_backend", "vision encoder: tensorrt, torch or onnxruntime (default: onnxruntime on cpu; "
           "on gpu tensorrt if the tensorrt package imports, else torch)", choices=BACKENDS)
    option("encoder_dtype", "onnxruntime: float32 (default) or float16; torch: float32, bfloat16 or float16 "
           "(default: bfloat16 on gpu, float32 on cpu); tensorrt: see --trt-precision",
           choices=("float32", "float16", "bfloat16"))
    option("encoder_instances", "instances of the batched vision encoder")
    option("encoder_frontends", "instances of the light vision_encoder front; 0: the cores on a GPU build (4 to 32), "
           "else 4")
    option("encoder_max_queue_delay_us", "dynamic batching delay")
    option("encoder_max_batch_patches", "patch rows per batched execution")
    c.add_argument("--encoder-cache-mb", type=int, default=defaults.encoder_cache_bytes >> 20,
                   help="embedding cache per encoder instance; 0: off")
    option("trt_min_patches", "--device gpu: TensorRT profile minimum")
    option("trt_opt_patches", "--device gpu: TensorRT profile optimum")
    option("trt_max_patches", "--device gpu: TensorRT profile maximum")
    option("trt_precision", choices=PRECISIONS)
    option("kv_cache_tokens", "llm KV cache pool size in tokens (wins over bytes)")
    c.add_argument("--kv-cache-mb", type=int, default=defaults.kv_cache_bytes >> 20,
                   help="llm KV cache pool size in MiB; both 0: on a GPU build what --gpu-memory-utilization "
                        "leaves of each GPU's memory after the weights, activations, graphs and encoders, else 256 MiB")
    option("gpu_memory_utilization", "--device gpu: the share of each GPU's memory the build plans for")
    option("kv_block_size", "tokens per KV cache block")
    option("prefix_caching", "reuse KV blocks of identical prompt prefixes (token ids, positions, media embeddings)",
           action=argparse.BooleanOptionalAction)
    option("llm_max_running", "requests in the llm's in-flight batch")
    option("llm_max_num_tokens", "llm rows per step (chunked prefill budget); 0: 8192 with the llm on CUDA, else 512")
    option("llm_device", "where the llm decoder runs: cpu, cuda or cuda:N (default: cpu; cuda with --device gpu, "
           "where cuda is each llm instance's own GPU)")
    option("llm_dtype", "llm weights, activations and KV cache: float32, bfloat16 or float16 "
           "(default: float32 on cpu, bfloat16 on cuda)")
    option("llm_cuda_graphs", "llm on CUDA: replay decode steps from CUDA graphs captured at start-up",
           choices=("on", "off"))
    option("llm_mixed_steps", "a step of the llm may hold prompt chunks and decodes together; --no-llm-mixed-steps: "
           "apart, so that on CUDA every decode-only step replays a graph", action=argparse.BooleanOptionalAction)
    option("llm_paged_prefill", "llm on CUDA: every prompt chunk of a step through one paged prefill kernel "
           "(the cache read in place) instead of SDPA per chunk", action=argparse.BooleanOptionalAction)
    option("tensor_parallel", "ranks each llm instance splits its decoder over (worker processes it starts; on "
           "CUDA rank r on the GPU r places after the instance's, NCCL; on the CPU gloo)")
    option("llm_queue_timeout_ms",
           "a request waiting longer for its first place in the llm batch gets UNAVAILABLE; 0: no limit")
    option("video_pruning_rate", "default EVS video pruning rate in [0, 1) (families with EVS; per request: "
           "mm_options video_pruning_rate): drops that share of each video's tokens, the least changed first")
    option("max_inflight_requests", "ensemble requests beyond this are refused at once with UNAVAILABLE")
    option("queue_timeout_ms", "Triton queue of preprocess, vision_encoder and vision_encoder_batch: a request "
           "waiting longer gets UNAVAILABLE; 0: no limit")
    option("max_queue_size", "requests each of those queues holds; beyond them UNAVAILABLE at once; 0: no limit")
    c.set_defaults(run=_build)

    c = sub.add_parser("serve", help="run tritonserver on a built repository")
    c.add_argument("--repo", required=True)
    c.add_argument("--host", default=ANY_HOST, help="the address the gRPC, HTTP and metrics endpoints bind (default "
                   f"{ANY_HOST}, tritonserver's own: every address of this machine; 127.0.0.1: this machine only)")
    c.add_argument("--http-port", type=int, default=8000)
    c.add_argument("--grpc-port", type=int, default=8001)
    c.add_argument("--metrics-port", type=int, default=8002)
    c.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every model to be ready")
    c.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV, ""),
                   help=f"the key (header {ADMIN_HEADER}) that opens Triton's shared-memory, model-repository, "
                        f"trace and logging APIs; default ${ADMIN_KEY_ENV}; without one they stay closed")
    c.set_defaults(run=_serve)

    c = sub.add_parser("infer", help="send one request over gRPC")
    c.add_argument("--url", default="127.0.0.1:8001")
    c.add_argument("--image", action="append", default=[])
    c.add_argument("--video", action="append", default=[])
    c.add_argument("--prompt", required=True, help="the question, put through the chat template with the media "
                   "before it; with --raw-prompt the whole prompt, sent as is")
    c.add_argument("--raw-prompt", action="store_true", help="send --prompt as is (no chat template)")
    c.add_argument("--checkpoint", help="read the chat template here (default: from the server)")
    c.add_argument("--max-tokens", type=int, default=64)
    c.add_argument("--stream", action="store_true")
    c.add_argument("--temperature", type=float)
    c.add_argument("--top-p", type=float)
    c.add_argument("--top-k", type=int)
    c.add_argument("--seed", type=int)
    c.add_argument("--repetition-penalty", type=float, help="> 1 discourages repeating prompt or generated tokens")
    c.add_argument("--stop", action="append", default=None, help="stop word (repeatable)")
    c.add_argument("--mm-options", help="JSON object: min_pixels, max_pixels, fps, num_frames, max_frames, "
                   "video_pruning_rate (families with EVS)")
    c.add_argument("--json", action="store_true", help="print one JSON object with token counts and timings")
    c.set_defaults(run=_infer)

    c = sub.add_parser("openai", help="OpenAI-compatible chat and text completions server in front of a running "
                                      "ensemble")
    c.add_argument("--url", default="127.0.0.1:8001", help="gRPC address of the running server")
    c.add_argument("--checkpoint", required=True, help="the served checkpoint (its chat template and family)")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, default=8080)
    c.add_argument("--model-name", help="the model id clients ask for (default: the checkpoint folder's name)")
    c.add_argument("--max-tokens", type=int, default=512, help="for a request that sets no max_tokens")
    c.set_defaults(run=_openai)

    c = sub.add_parser("bench", help="perf_analyzer or genai-perf load test of the ensemble; prints a table")
    where = c.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="gRPC address of a running server")
    where.add_argument("--repo", help="start a server on this repository for the run")
    c.add_argument("--tool", choices=("perf_analyzer", "genai-perf"), default="perf_analyzer")
    c.add_argument("--endpoints", default="kserve,generate",
                   help="genai-perf: kserve (gRPC, tensorrtllm inputs), generate (HTTP generate_stream), "
                        "chat and multimodal (OpenAI, multimodal with synthetic images)")
    c.add_argument("--http-url", help="genai-perf generate: HTTP address of the server given by --url")
    c.add_argument("--openai-url", help="genai-perf chat / multimodal: address of an OpenAI-compatible server "
                                        "(triton-vlm openai)")
    c.add_argument("--tokenizer", help="genai-perf: the checkpoint whose tokenizer counts tokens (default with --repo: "
                                       "the repository's copy)")
    c.add_argument("--image-size", type=int, default=448, help="genai-perf multimodal: side of its synthetic images")
    c.add_argument("--family", default=DEFAULT_FAMILY, help="whose placeholders the generated prompts use")
    c.add_argument("--kinds", default="text,image,video", help="request kinds, comma-separated")
    c.add_argument("--concurrency", default="1:4:1", help="perf_analyzer --concurrency-range start:end:step "
                                                          "(genai-perf: start and end only)")
    c.add_argument("--max-tokens", type=int, default=16)
    c.add_argument("--window-requests", type=int, default=8, help="requests per measurement window")
    c.set_defaults(run=_bench)

    c = sub.add_parser("demo", help="checkpoint, build, serve, one image + video request streamed, stop")
    c.add_argument("--workdir", default="build/demo")
    c.add_argument("--size", choices=("tiny", "small"), default="small")
    c.add_argument("--family", default=DEFAULT_FAMILY, choices=FAMILIES)
    c.set_defaults(run=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
