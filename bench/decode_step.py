"""One decode step of the `llm` runner, the CPU's dense decode mirror (`DecodeCache`) against the
block gather of the reference attention path, on the `small` random-weight checkpoint:

    HF_HUB_OFFLINE=1 .venv/bin/python bench/decode_step.py [--family qwen2_5_vl] [--steps 30]

For each (sequences, context tokens) point both runners hold the same sequences (prefilled once),
then decode steps alternate between them, so machine noise hits both alike (the mirror may take up to
1 GiB, so it never declines here); it prints the fastest
and the median step of each and the gather / mirror ratio. Logits of the two paths are compared too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

POINTS = ((4, 300), (16, 300), (16, 1000), (32, 300), (64, 300))


def main() -> None:
    from triton_vlm.checkpoint import write_demo_checkpoint
    from triton_vlm.llm import BlockManager, DecoderModel, ModelRunner, SamplingParams
    from triton_vlm.llm.scheduler import ScheduledChunk
    from triton_vlm.llm.sequence import Sequence

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen2_5_vl")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    ckpt = write_demo_checkpoint(args.family, tempfile.mkdtemp(prefix="decode-step-"), "small")
    model = DecoderModel.from_checkpoint(ckpt)
    vocab = model.config.vocab_size
    print(f"{args.family} small, torch threads {torch.get_num_threads()}, fastest / median of {args.steps} steps")
    print("| sequences | context | mirror ms | gather ms | gather / mirror | max logit diff |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for num_seqs, context in POINTS:
        runs = {}
        for name, cache_bytes in (("mirror", 1 << 30), ("gather", 0)):
            blocks = BlockManager(-(-num_seqs * (context + 3 * num_seqs + args.steps + 1) // 16) + num_seqs, 16,
                                  state_slots=num_seqs)
            runner = ModelRunner(model, blocks.num_blocks, 16, state_slots=num_seqs, decode_cache_bytes=cache_bytes)
            seqs = []
            for i in range(num_seqs):
                n = context + 3 * i  # contexts differ, as in a real batch
                ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(i)).tolist()
                seq = Sequence(str(i), n, ids, None, None, torch.arange(n).expand(3, n), 0,
                               SamplingParams(max_tokens=1), lambda out: None, lambda: False, None, None, arrival=i,
                               blocks=blocks.allocate(blocks.blocks_for(n + args.steps + 1)),
                               state=blocks.allocate_state() if model.config.recurrent else None)
                runner.forward([ScheduledChunk.of(seq, n)])
                seq.num_computed = n
                seq.tokens.append(1)
                seqs.append(seq)
            runs[name] = (runner, seqs, [], [])
        for _ in range(args.steps):
            for runner, seqs, times, logits in runs.values():
                chunks = [ScheduledChunk.of(s, len(s.tokens)) for s in seqs]
                t0 = time.perf_counter()
                logits.append(runner.forward(chunks))
                times.append(time.perf_counter() - t0)
                for s in seqs:
                    s.num_computed = len(s.tokens)
                    s.tokens.append(1)
        (_, _, mt, ml), (_, _, gt, gl) = runs["mirror"], runs["gather"]
        diff = max(float((a - b).abs().max()) for a, b in zip(ml, gl))
        print(f"| {num_seqs} | {context} | {min(mt) * 1e3:.1f} / {statistics.median(mt) * 1e3:.1f} "
              f"| {min(gt) * 1e3:.1f} / {statistics.median(gt) * 1e3:.1f} "
              f"| {statistics.median(gt) / statistics.median(mt):.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
