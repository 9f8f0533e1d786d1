"""llm decoder benchmark (issue #5): our engine (paged KV cache, in-flight batching) against
transformers' `generate` run one request at a time, on the same device and dtype.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/decoder.py [--family qwen2_5_vl] [--rounds 2] [--max-tokens 64]
    HF_HUB_OFFLINE=1 .venv/bin/python bench/decoder.py --device cuda --decoder-7b --concurrency 1,16,64 --json out.json
    HF_HUB_OFFLINE=1 .venv/bin/python bench/decoder.py --evs 0.5 [--evs-seconds 60]
    HF_HUB_OFFLINE=1 .venv/bin/python bench/decoder.py --family qwen3_vl   (or qwen3_vl_moe: Qwen3 decoders)
    HF_HUB_OFFLINE=1 .venv/bin/python bench/decoder.py --guided --concurrency 16

Checkpoint: the family's `small` random-weight demo checkpoint (default), `--checkpoint DIR`, or
`--decoder-7b`: a Qwen2.5-VL with the 7B's text stack (28 layers, hidden 3584, 28 query / 4 KV
heads, intermediate 18944, vocab 152064, M-RoPE sections [16, 24, 24], rope theta 1e6), random
weights in `--dtype` and a tiny vision tower, written by the demo-checkpoint code with size
overrides (`--layers` / `--hidden` shrink it for a smoke run; `--save DIR` keeps it for `--checkpoint`).

Both run on the same device, interleaved round by round (transformers, then our engine at each
`--concurrency`), so machine noise hits both alike. transformers runs in a child process (it writes
the demo checkpoint, loads the model and measures the copy bandwidth there): each process then has
one thread running OpenMP regions (ours: the engine's scheduler thread), as a server would; two
such threads in one process slow each other's small ops several-fold (see `Engine`). Prompts: chat prompts of 16
lengths (68 to 412 tokens on the `small` tokenizer; past 16 requests the lengths repeat with other
words), greedy, `max_tokens` new tokens each. Concurrency 1 runs 4 requests, concurrency c > 1 runs
max(--requests, c), c at a time (closed loop). Throughput is generated tokens / wall time of the
whole batch of requests; time to first token (TTFT) is from submit to the first token, median over
the requests of that run.

`--guided`: also each concurrency with every request constrained to JSON lines (`GUIDED`), on the
same engine and prompts, interleaved with the plain runs, every request of both `max_tokens` long
(`min_tokens`); its decode time per token against the plain run's (the grammar's per-step cost:
the bitmask filled per row and applied before sampling).

`--evs Q`: instead, the prefill saved by EVS video pruning (triton_vlm.media.evs). One prompt holding a
`--evs-seconds` 224x168 video (sampled at 2 fps; the `small` checkpoint's context is 4096 tokens),
through our `Preprocessor` at q = 0 and at q = Q, the checkpoint's vision tower (transformers)
once, the mask; then our engine's prefill (time to the first token, `max_tokens` 1) of each,
interleaved for `--rounds` rounds; medians and their ratio.

Also measured in the run: the device's copy bandwidth (bytes read + written by a large
device-to-device copy, best of 5) and the weight-streaming floor of one decode step (the bytes of
decoder weights a step reads: every layer, the final norm and the LM head, not the embedding table;
divided by that bandwidth). The engine's concurrency-1 decode time per token (median over requests
of (last token - first token) / (tokens - 1)) is printed against that floor.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

WORDS = ("red car road tree river small large city house light dark blue green yellow cat dog "
         "runs jumps over under quickly slowly bright morning evening cloud rain snow wind").split()
PROMPT_LENGTHS = 16  # prompt i has 20 + 9 * (i % 16) words

# Qwen2.5-VL-7B's text stack (its config.json); --hidden scales it at the same head size and grouping.
DECODER_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, mrope_section=[16, 24, 24])
VOCAB_7B = 152064
HEAD_DIM_7B, GROUP_7B = 128, 7  # 28 / 4 query heads per KV head

# Goals of the GPU run: concurrency-1 decode time within 1.4x the weight-streaming floor, and
# throughput at least these multiples of transformers one request at a time.
GOAL_FLOOR_RATIO = 1.4
GOAL_X_TRANSFORMERS = {1: 3.0, 64: 20.0}
# `--guided`: every request constrained to JSON lines of records (as a form reader answers), by a
# regular expression xgrammar compiles once (cached by the engine); a record may always follow the
# last, so with min_tokens = max_tokens (both runs) every request generates max_tokens tokens.
GUIDED = dict(guide_type="regex",
              guide=r'(\{"name": "[a-z ]{0,12}", "count": [0-9]{1,3}, "seen": (true|false)\}\n)+')


@dataclass
class Run:
    tokens: int
    seconds: float
    ttfts: list[float]
    decode_per_token: list[float] = field(default_factory=list)  # per request with >= 2 tokens


def prompts(n: int, chat_template: str, seed: int = 0) -> list[str]:
    """`n` user turns through the checkpoint's chat template, of 16 growing lengths."""
    import random

    from jinja2 import Template

    rng = random.Random(seed)
    template = Template(chat_template)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(20 + 9 * (i % PROMPT_LENGTHS)))
        out.append(template.render(messages=[{"role": "user", "content": f"Describe this: {words}"}],
                                   add_generation_prompt=True))
    return out


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU and its cores, as the figures name the device they ran on."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, repeats: int = 5) -> float:
    """Bytes per second read + written by a device-to-device copy of 1 GiB (CUDA) or 256 MiB (CPU), best of `repeats`."""
    n = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy warms up
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * n / best


def decode_weight_bytes(hf) -> int:
    """Bytes of weights one decode step reads: the language model's layers and final norm, and the LM
    head (read in full even where it is tied); the embedding table is only indexed."""
    lm = hf.model.language_model
    embed = lm.get_input_embeddings().weight
    head = hf.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in lm.parameters() if p is not embed) \
        + head.numel() * head.element_size()


def run_hf(model, inputs: list[list[int]], max_tokens: int, device: torch.device) -> Run:
    """One request at a time; TTFT from a separate 1-token generate of each of the first 4 prompts."""
    tokens, ttfts = 0, []
    inputs = [torch.tensor(ids, device=device) for ids in inputs]
    sync(device)
    start = time.perf_counter()
    for ids in inputs:
        out = model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]),
                             max_new_tokens=max_tokens, do_sample=False)
        tokens += out.shape[1] - ids.numel()
    sync(device)
    elapsed = time.perf_counter() - start
    for ids in inputs[:4]:
        t0 = time.perf_counter()
        model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=1,
                       do_sample=False)
        sync(device)
        ttfts.append(time.perf_counter() - t0)
    return Run(tokens, elapsed, ttfts)


def transformers_process(conn, write: dict | None, ckpt: str, device: str, dtype: str) -> None:
    """The child process: writes the checkpoint (`write`: `write_demo_checkpoint` arguments), loads
    transformers' model, reports its facts, then runs `run_hf` on each `(inputs, max_tokens)` it gets
    until None."""
    from transformers import AutoModelForImageTextToText

    from triton_vlm.families.demo import write_demo_checkpoint

    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    if write:
        write_demo_checkpoint(**write)
    written = time.perf_counter() - t0
    device = torch.device(device)
    hf = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=getattr(torch, dtype)).to(device).eval()
    text = hf.config.text_config
    conn.send(dict(parameters=sum(p.numel() for p in hf.parameters()), layers=text.num_hidden_layers,
                   hidden=text.hidden_size, bandwidth=copy_bandwidth(device), weight_bytes=decode_weight_bytes(hf),
                   written_s=written, torch_threads=torch.get_num_threads()))
    while (job := conn.recv()) is not None:
        conn.send(run_hf(hf, *job, device))


def run_engine(engine, inputs: list, max_tokens: int, concurrency: int, min_tokens: int = 0,
               sampling: dict | None = None, **extra) -> Run:
    """`concurrency` requests in flight at a time until all are done (closed loop). Each input is a
    prompt's token ids, the tuple of `Engine.submit`'s (input_ids, embeddings, mrope_position_ids,
    mrope_position_delta), or a dict of submit's keywords; `sampling`, more `SamplingParams` fields;
    `extra`, submit's keywords for every input. Emits come after the step's sampled ids reached the
    host, so their times need no device sync."""
    from triton_vlm.llm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, **(sampling or {}))
    slots = threading.Semaphore(concurrency)
    done = threading.Event()
    lock = threading.Lock()
    state = {"left": len(inputs), "tokens": 0}
    ttfts: list[float] = []
    decode: list[float] = []

    def emit_for(t0: float):
        first: list[float] = []  # time of the first token
        count = [0]

        def emit(out):
            now = time.perf_counter()
            with lock:
                state["tokens"] += len(out.token_ids)
                count[0] += len(out.token_ids)
                if not first and out.token_ids:
                    first.append(now)
                    ttfts.append(now - t0)
                if out.finish_reason is not None:
                    if count[0] >= 2:
                        decode.append((now - first[0]) / (count[0] - 1))
                    state["left"] -= 1
                    slots.release()
                    if state["left"] == 0:
                        done.set()
        return emit

    start = time.perf_counter()
    for i, prompt in enumerate(inputs):
        slots.acquire()
        request_id = f"b{concurrency}-{i}-{time.monotonic_ns()}"
        if isinstance(prompt, dict):
            engine.submit(request_id, **prompt, params=params, emit=emit_for(time.perf_counter()), **extra)
            continue
        args = prompt if isinstance(prompt, tuple) else (prompt, None, None, None)
        engine.submit(request_id, *args, params, emit=emit_for(time.perf_counter()), **extra)
    done.wait()
    return Run(state["tokens"], time.perf_counter() - start, ttfts, decode)


def decoder_7b_overrides(layers: int, hidden: int, dtype: torch.dtype, device: torch.device) -> dict:
    """`write_demo_checkpoint` overrides of the `small` Qwen2.5-VL demo: the 7B text stack (scaled to
    `hidden` at the same head size and grouping), its padded vocabulary, `tiny`'s vision tower."""
    from triton_vlm.families import get_family

    if hidden % (HEAD_DIM_7B * GROUP_7B):
        raise SystemExit(f"--hidden must be a multiple of {HEAD_DIM_7B * GROUP_7B} "
                         f"(head size {HEAD_DIM_7B}, {GROUP_7B} query heads per KV head)")
    heads = hidden // HEAD_DIM_7B
    text = dict(DECODER_7B, num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=heads // GROUP_7B,
                intermediate_size=DECODER_7B["intermediate_size"] * hidden // DECODER_7B["hidden_size"])
    return dict(text=text, vision=get_family("qwen2_5_vl").demo_spec().sizes["tiny"]["vision"], model_vocab_size=VOCAB_7B,
                dtype=str(dtype).removeprefix("torch."), device=str(device))


def make_engine(ckpt: Path, device: torch.device, dtype: torch.dtype, max_running: int, need_tokens: int,
                cuda_graphs: bool = True, mixed_steps: bool = True, paged_prefill: bool = False, model=None):
    """Our engine with a KV pool of at least `need_tokens` (the default pool where that is enough)."""
    from triton_vlm.llm import Engine

    kwargs = {"device": str(device), "dtype": dtype, "cuda_graphs": cuda_graphs, "mixed_steps": mixed_steps,
              "paged_prefill": paged_prefill}
    engine = Engine(ckpt, model=model, max_running=max_running, max_num_tokens=512, **kwargs)
    if engine.pool_tokens < need_tokens:
        model = engine.model
        engine.shutdown()
        engine = Engine(ckpt, model=model, max_running=max_running, max_num_tokens=512, kv_cache_tokens=need_tokens,
                        **kwargs)
    return engine


def graph_replay_ms(engine, device: torch.device, repeats: int = 50) -> float | None:
    """GPU time of one batch-1 decode step: the mean of `repeats` back-to-back replays of its CUDA
    graph (on a stopped engine: the replays rewrite a slot of the last, finished, request)."""
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    graph = graphs.graphs[graphs.sizes[0]]
    graph.replay()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    sync(device)
    return (time.perf_counter() - t0) / repeats * 1000


def time_prefill(engine, out, embeddings, kept_rows) -> float:
    """Seconds from submit to the first token of one preprocessed prompt (`max_tokens` 1)."""
    from triton_vlm.llm import SamplingParams

    done = threading.Event()
    start = time.perf_counter()
    engine.submit(f"evs-{time.monotonic_ns()}", out.input_ids, embeddings, out.mrope_position_ids,
                  out.mrope_position_delta, SamplingParams(max_tokens=1), emit=lambda o: done.set(),
                  media_position_ids=out.media_position_ids, kept_rows=kept_rows)
    done.wait()
    return time.perf_counter() - start


@torch.no_grad()
def evs_prefill(args, ckpt: Path, device: torch.device, dtype: torch.dtype) -> None:
    """`--evs Q`: prefill of a long video prompt at q = 0 and at q = Q, in one run."""
    from transformers import AutoModelForImageTextToText

    from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL
    from triton_vlm.media import samples
    from triton_vlm.media.evs import prune
    from triton_vlm.preprocessing.preprocessor import Preprocessor

    prompt = QWEN2_5_VL.video_placeholder + "What happens in this video?"
    video = samples.video_bytes(seconds=args.evs_seconds, fps=10, width=224, height=168)
    pre = Preprocessor(ckpt)
    t0 = time.perf_counter()
    full = pre(prompt, [], [video])
    t_pre = time.perf_counter() - t0
    pruned = pre(prompt, [], [video], {"video_pruning_rate": args.evs})
    visual = AutoModelForImageTextToText.from_pretrained(ckpt).model.visual.eval()
    t0 = time.perf_counter()
    embeddings = visual(torch.from_numpy(full.pixel_values), grid_thw=torch.from_numpy(full.grid_thw)).pooler_output
    t_tower = time.perf_counter() - t0
    del visual
    embeddings = embeddings.numpy()
    merge = int(json.loads((ckpt / "config.json").read_text())["vision_config"]["spatial_merge_size"])
    t0 = time.perf_counter()
    kept_embeddings, kept = prune(embeddings, full.grid_thw, merge, args.evs)
    t_mask = time.perf_counter() - t0
    engine = make_engine(ckpt, device, dtype, 4, need_tokens=full.input_ids.size + 64)
    cases = {"q = 0": (full, embeddings, None), f"q = {args.evs:g}": (pruned, kept_embeddings, kept)}
    for case in cases.values():  # warm-up
        time_prefill(engine, *case)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            times[name].append(time_prefill(engine, *case))
    engine.shutdown()
    print(f"{args.evs_seconds:g} s 224x168 video, 2 fps: grid {full.grid_thw.tolist()}; preprocess "
          f"{t_pre * 1000:.0f} ms, vision tower (transformers) {t_tower * 1000:.0f} ms, "
          f"EVS mask {t_mask * 1000:.1f} ms; {device}, {str(dtype).removeprefix('torch.')}, {args.rounds} rounds")
    print(f"{'case':10} {'prompt tokens':>14} {'prefill ms (median)':>20}")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, (out, _, _) in cases.items():
        print(f"{name:10} {out.input_ids.size:14d} {medians[name] * 1000:20.0f}")
    base, ours = medians["q = 0"], medians[f"q = {args.evs:g}"]
    print(f"prefill at q = {args.evs:g}: {ours / base:.2f}x the time of q = 0 ({(1 - ours / base) * 100:.0f}% "
          f"saved), {pruned.input_ids.size / full.input_ids.size:.2f}x the tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a checkpoint dir (default: write the family's `small` demo checkpoint)")
    ap.add_argument("--family", default="qwen2_5_vl", help="demo checkpoint family (without --checkpoint)")
    ap.add_argument("--decoder-7b", action="store_true",
                    help="write a random-weight Qwen2.5-VL with the 7B's text stack and a tiny vision tower")
    ap.add_argument("--layers", type=int, help=f"with --decoder-7b (default {DECODER_7B['num_hidden_layers']})")
    ap.add_argument("--hidden", type=int, help=f"with --decoder-7b (default {DECODER_7B['hidden_size']}): "
                                               f"a multiple of {HEAD_DIM_7B * GROUP_7B}")
    ap.add_argument("--save", help="write the demo / --decoder-7b checkpoint here and keep it (default: a temp dir)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                    help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--cuda-graphs", choices=("on", "off"), default="on", help="the engine's decode CUDA graphs (cuda)")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated engine concurrencies")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16, help="requests per measurement (at least the concurrency)")
    ap.add_argument("--steps-apart", action="store_true",
                    help="also an engine whose steps hold prompt chunks or decodes, never both (mixed_steps off), "
                         "on the same model, interleaved with the default one in each round")
    ap.add_argument("--paged-prefill", action="store_true",
                    help="also an engine whose prompt chunks go through the paged prefill kernel (paged_prefill; "
                         "CUDA only), on the same model, interleaved with the default one in each round")
    ap.add_argument("--guided", action="store_true",
                    help="also run every concurrency with each request constrained by a JSON schema (xgrammar)")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--evs", type=float,
                    help="instead: prefill of a video prompt at this EVS pruning rate against q = 0")
    ap.add_argument("--evs-seconds", type=float, default=60.0, help="with --evs: the video's length")
    args = ap.parse_args()
    if args.evs is not None:
        device = torch.device(args.device)
        dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
        with tempfile.TemporaryDirectory() as tmp:
            from triton_vlm.families.demo import write_demo_checkpoint

            ckpt = Path(args.checkpoint) if args.checkpoint else write_demo_checkpoint(
                "qwen2_5_vl", Path(args.save or tmp) / "small", "small")
            evs_prefill(args, ckpt, device, dtype)
        return
    if args.decoder_7b and (args.checkpoint or args.family != "qwen2_5_vl"):
        ap.error("--decoder-7b writes its own Qwen2.5-VL checkpoint: no --checkpoint or --family")
    if not args.decoder_7b and (args.layers or args.hidden):
        ap.error("--layers and --hidden size the --decoder-7b checkpoint")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))

    import multiprocessing

    from tokenizers import Tokenizer

    from triton_vlm.families import detect_family

    tmp = None
    write = None
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
    else:
        if not args.save:
            tmp = tempfile.TemporaryDirectory()
        ckpt = Path(args.save) if args.save else Path(tmp.name) / ("decoder-7b" if args.decoder_7b else "small")
        if args.decoder_7b:
            overrides = decoder_7b_overrides(args.layers or DECODER_7B["num_hidden_layers"],
                                             args.hidden or DECODER_7B["hidden_size"], dtype, device)
            write = dict(family_name="qwen2_5_vl", out=ckpt, size="small", overrides=overrides)
        else:
            write = dict(family_name=args.family, out=ckpt, size="small")
    conn, child_conn = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(
        target=transformers_process, args=(child_conn, write, str(ckpt), str(device), str(dtype).removeprefix("torch.")),
        daemon=True)
    child.start()
    child_conn.close()  # the child's end is the child's alone: its death ends `recv` (EOFError) instead of a wait for good
    facts = conn.recv()
    if write:
        print(f"wrote {ckpt} in {facts['written_s']:.0f} s")
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    chat_template = (ckpt / "chat_template.jinja").read_text()
    n_inputs = max(args.requests, *concurrency)
    inputs = [tok.encode(p, add_special_tokens=False).ids for p in prompts(n_inputs, chat_template)]
    longest = max(len(i) for i in inputs)
    # room for every request in flight at once: no preemption in the measurement
    need_tokens = max(concurrency) * (longest + args.max_tokens + 16)
    engine = make_engine(ckpt, device, dtype, max(64, *concurrency), need_tokens, cuda_graphs=args.cuda_graphs == "on")
    engines = {"engine": engine}
    if args.steps_apart:
        engines["engine, steps apart"] = make_engine(ckpt, device, dtype, max(64, *concurrency), need_tokens,
                                                     cuda_graphs=args.cuda_graphs == "on", mixed_steps=False,
                                                     model=engine.model)
    if args.paged_prefill:
        engines["engine, paged prefill"] = make_engine(ckpt, device, dtype, max(64, *concurrency), need_tokens,
                                                       cuda_graphs=args.cuda_graphs == "on", paged_prefill=True,
                                                       model=engine.model)
    name = device_name(device)
    n_params = facts["parameters"]
    print(f"checkpoint {ckpt.name} ({detect_family(ckpt).name}): {n_params / 1e6:.1f} M parameters "
          f"({facts['layers']} layers, hidden {facts['hidden']}); "
          f"{name}, {str(dtype).removeprefix('torch.')}; torch threads {facts['torch_threads']}; "
          f"{len(inputs)} prompts of {min(len(i) for i in inputs)}..{longest} tokens, "
          f"max_tokens {args.max_tokens}, greedy")

    bandwidth, weight_bytes = facts["bandwidth"], facts["weight_bytes"]
    floor = weight_bytes / bandwidth
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + written); decode step reads "
          f"{weight_bytes / 1e9:.3f} GB of weights: floor {floor * 1000:.2f} ms per step")

    def hf_run(subset: list[list[int]], max_tokens: int) -> Run:
        conn.send((subset, max_tokens))
        return conn.recv()

    # warm up each
    hf_run(inputs[:1], 4)
    for each in engines.values():
        run_engine(each, inputs[:4], 4, 4)

    hf_name = "transformers (one at a time)"
    results: dict[str, list[Run]] = {}
    for _ in range(args.rounds):
        results.setdefault(hf_name, []).append(hf_run(inputs[:args.requests], args.max_tokens))
        for c in concurrency:
            subset = inputs[:4] if c == 1 else inputs[:max(args.requests, c)]
            for name, each in engines.items():
                results.setdefault(f"{name}, concurrency {c}", []).append(
                    run_engine(each, subset, args.max_tokens, c, min_tokens=args.max_tokens if args.guided else 0))
            if args.guided:
                results.setdefault(f"engine, guided, concurrency {c}", []).append(
                    run_engine(engine, subset, args.max_tokens, c, min_tokens=args.max_tokens, sampling=GUIDED))
    for each in engines.values():
        each.shutdown()
    replay_ms = graph_replay_ms(engine, device)
    conn.send(None)
    child.join()

    figures: dict = {"device": name, "dtype": str(dtype).removeprefix("torch."), "checkpoint": str(ckpt),
                     "cuda_graphs": device.type == "cuda" and engine.runner.graphs is not None,
                     "parameters": n_params, "layers": facts["layers"],
                     "hidden": facts["hidden"], "torch_threads": facts["torch_threads"],
                     "max_tokens": args.max_tokens, "rounds": args.rounds, "copy_bandwidth_gb_s": bandwidth / 1e9,
                     "decode_weight_bytes": weight_bytes, "floor_ms_per_step": floor * 1000, "runs": {}}
    hf_runs = results[hf_name]
    base = sum(r.tokens for r in hf_runs) / sum(r.seconds for r in hf_runs)
    print(f"\n{'path':36} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'x HF':>6} {'TTFT ms (median)':>17}")
    for name, runs in results.items():
        tokens, seconds = sum(r.tokens for r in runs), sum(r.seconds for r in runs)
        ttft = statistics.median([x for r in runs for x in r.ttfts]) * 1000
        rate = tokens / seconds
        # per round: each engine row against the transformers run of the same round (on a shared
        # machine load changes between rounds; a ratio within one round is the fairer comparison)
        per_round = [(r.tokens / r.seconds) / (h.tokens / h.seconds) for r, h in zip(runs, hf_runs)]
        print(f"{name:36} {tokens:7d} {seconds:8.2f} {rate:8.1f} {rate / base:6.2f} {ttft:17.1f}")
        figures["runs"][name] = dict(tokens=tokens, seconds=seconds, tokens_per_s=rate, x_transformers=rate / base,
                                     x_transformers_per_round=per_round, ttft_ms_median=ttft)
    print("\nper round, x transformers of the same round:")
    for name, run in figures["runs"].items():
        if name != hf_name:
            print(f"{name:36} " + " ".join(f"{x:6.2f}" for x in run["x_transformers_per_round"]))

    if args.guided:
        print("\nguided (JSON lines) against unconstrained, same engine and prompts: decode time per token "
              "(median over requests), tokens per request")
        for c in concurrency:
            plain, guided = results[f"engine, concurrency {c}"], results[f"engine, guided, concurrency {c}"]
            step = [statistics.median([x for r in runs for x in r.decode_per_token]) for runs in (plain, guided)]
            per_request = [sum(r.tokens for r in runs) / sum(len(r.ttfts) for r in runs) for runs in (plain, guided)]
            figures.setdefault("guided", {})[c] = dict(decode_ms_per_token=[x * 1000 for x in step],
                                                       tokens_per_request=per_request, x_decode=step[1] / step[0])
            print(f"concurrency {c:3d}: {step[0] * 1000:7.2f} -> {step[1] * 1000:7.2f} ms per token "
                  f"({step[1] / step[0]:.3f}x); {per_request[0]:.1f} -> {per_request[1]:.1f} tokens per request")
    c1 = results.get("engine, concurrency 1")
    if c1 and any(r.decode_per_token for r in c1):
        step = statistics.median([x for r in c1 for x in r.decode_per_token])
        figures.update(c1_decode_ms_per_token=step * 1000, c1_decode_x_floor=step / floor)
        print(f"\nconcurrency 1 decode: {step * 1000:.2f} ms per token, {step / floor:.2f}x the "
              f"weight-streaming floor ({floor * 1000:.2f} ms)")
    if replay_ms is not None:
        figures.update(c1_graph_replay_ms=replay_ms)
        print(f"one batch-1 decode step on the GPU alone (graph replay): {replay_ms:.2f} ms, "
              f"{replay_ms / (floor * 1000):.2f}x the floor; the rest of a step is the host's")
    if device.type == "cuda":
        goals = {}
        if "c1_decode_x_floor" in figures:
            goals["c1 decode <= 1.4x floor"] = figures["c1_decode_x_floor"] <= GOAL_FLOOR_RATIO
        for c, goal in GOAL_X_TRANSFORMERS.items():
            run = figures["runs"].get(f"engine, concurrency {c}")
            if run:
                goals[f"concurrency {c} >= {goal:g}x transformers"] = run["x_transformers"] >= goal
        figures["goals"] = goals
        print("goals: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
