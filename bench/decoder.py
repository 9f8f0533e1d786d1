"""llm decoder benchmark (issue #5): our engine (paged KV cache, in-flight batching) against
transformers' `generate` run one request at a time, on the `small` random-weight checkpoint.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/decoder.py [--family qwen2_5_vl] [--rounds 2] [--max-tokens 64]

Both run in this process on the same CPU threads, interleaved round by round (transformers, then our
engine at concurrency 1, 4 and 16), so machine noise hits both alike. Prompts: 16 chat prompts of
different lengths (68 to 412 tokens), greedy, `max_tokens` new tokens each. Throughput is
generated tokens / wall time of the whole batch of requests; time to first token (TTFT) is from
submit to the first token, median over the requests of that run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

WORDS = ("red car road tree river small large city house light dark blue green yellow cat dog "
         "runs jumps over under quickly slowly bright morning evening cloud rain snow wind").split()


def prompts(n: int, chat_template: str, seed: int = 0) -> list[str]:
    """`n` user turns of growing length through the checkpoint's chat template."""
    import random

    from jinja2 import Template

    rng = random.Random(seed)
    template = Template(chat_template)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(20 + 9 * i))
        out.append(template.render(messages=[{"role": "user", "content": f"Describe this: {words}"}],
                                   add_generation_prompt=True))
    return out


def run_hf(model, inputs: list[torch.Tensor], max_tokens: int) -> tuple[int, float, list[float]]:
    """One request at a time; TTFT from a separate 1-token generate of each prompt."""
    tokens, ttfts = 0, []
    start = time.perf_counter()
    for ids in inputs:
        out = model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]),
                             max_new_tokens=max_tokens, do_sample=False)
        tokens += out.shape[1] - ids.numel()
    elapsed = time.perf_counter() - start
    for ids in inputs[:4]:
        t0 = time.perf_counter()
        model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=1,
                       do_sample=False)
        ttfts.append(time.perf_counter() - t0)
    return tokens, elapsed, ttfts


def run_engine(engine, inputs: list[torch.Tensor], max_tokens: int, concurrency: int) -> tuple[int, float, list[float]]:
    """`concurrency` requests in flight at a time until all are done (closed loop)."""
    from triton_vlm.llm import SamplingParams

    slots = threading.Semaphore(concurrency)
    done = threading.Event()
    lock = threading.Lock()
    state = {"left": len(inputs), "tokens": 0}
    ttfts: list[float] = []

    def emit_for(t0):
        first = [True]

        def emit(out):
            with lock:
                state["tokens"] += len(out.token_ids)
                if first[0] and out.token_ids:
                    first[0] = False
                    ttfts.append(time.perf_counter() - t0)
                if out.finish_reason is not None:
                    state["left"] -= 1
                    slots.release()
                    if state["left"] == 0:
                        done.set()
        return emit

    start = time.perf_counter()
    for i, ids in enumerate(inputs):
        slots.acquire()
        engine.submit(f"b{concurrency}-{i}-{time.monotonic_ns()}", ids, None, None, None,
                      SamplingParams(max_tokens=max_tokens), emit=emit_for(time.perf_counter()))
    done.wait()
    return state["tokens"], time.perf_counter() - start, ttfts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a checkpoint dir (default: write the family's `small` demo checkpoint)")
    ap.add_argument("--family", default="qwen2_5_vl", help="demo checkpoint family (without --checkpoint)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16, help="requests per measurement")
    args = ap.parse_args()

    from tokenizers import Tokenizer
    from transformers import AutoModelForImageTextToText

    from triton_vlm.checkpoint import write_demo_checkpoint
    from triton_vlm.families import detect_family
    from triton_vlm.llm import Engine

    tmp = None
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
    else:
        tmp = tempfile.TemporaryDirectory()
        ckpt = write_demo_checkpoint(args.family, Path(tmp.name) / "small", "small")
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    chat_template = (ckpt / "chat_template.jinja").read_text()
    inputs = [torch.tensor(tok.encode(p, add_special_tokens=False).ids) for p in prompts(args.requests, chat_template)]
    torch.set_grad_enabled(False)
    hf = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    engine = Engine(ckpt, max_running=64, max_num_tokens=512)
    print(f"checkpoint {ckpt.name} ({detect_family(ckpt).name}): {sum(p.numel() for p in hf.parameters()) / 1e6:.1f} M parameters; "
          f"torch threads {torch.get_num_threads()}; {len(inputs)} prompts of "
          f"{min(i.numel() for i in inputs)}..{max(i.numel() for i in inputs)} tokens, "
          f"max_tokens {args.max_tokens}, greedy")

    # warm up both
    hf.generate(input_ids=inputs[0][None], attention_mask=torch.ones_like(inputs[0][None]), max_new_tokens=4)
    run_engine(engine, inputs[:4], 4, 4)

    results: dict[str, list[tuple[int, float, list[float]]]] = {}
    for r in range(args.rounds):
        results.setdefault("transformers (one at a time)", []).append(run_hf(hf, inputs, args.max_tokens))
        for c in (1, 4, 16):
            subset = inputs[:max(4, c)] if c == 1 else inputs
            results.setdefault(f"engine, concurrency {c}", []).append(run_engine(engine, subset, args.max_tokens, c))
    engine.shutdown()

    base = None
    print(f"\n{'path':32} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'x HF':>6} {'TTFT ms (median)':>17}")
    for name, runs in results.items():
        tokens = sum(t for t, _, _ in runs)
        seconds = sum(s for _, s, _ in runs)
        ttft = statistics.median([x for _, _, ts in runs for x in ts]) * 1000
        rate = tokens / seconds
        base = base or rate
        print(f"{name:32} {tokens:7d} {seconds:8.2f} {rate:8.1f} {rate / base:6.2f} {ttft:17.1f}")
    # per round: each engine row against the transformers run of the same round (the machine is
    # shared, so load changes between rounds; a ratio within one round is the fairer comparison)
    hf_runs = results["transformers (one at a time)"]
    print("\nper round, x transformers of the same round:")
    for name, runs in results.items():
        if name.startswith("engine"):
            ratios = [(t / s) / (ht / hs) for (t, s, _), (ht, hs, _) in zip(runs, hf_runs)]
            print(f"{name:32} " + " ".join(f"{x:6.2f}" for x in ratios))
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
