"""`sample_batch` against transformers' logits processors and `torch.multinomial` (same generator
state, token for token), and its batch invariance."""
from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from triton_vlm.llm.sampling import NO_TOKEN, SamplingParams, make_generator, sample_batch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def copy_of(gen: torch.Generator) -> torch.Generator:
    twin = torch.Generator(device=gen.device)
    twin.set_state(gen.get_state())
    return twin


def hf_reference(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator,
                 context: torch.Tensor | None) -> int:
    """One row as `generate` samples it: transformers' processors, then softmax and torch.multinomial."""
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if not params.greedy:
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            processors.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(params.top_p))
    ids = (context if context is not None else torch.zeros(0, dtype=torch.long)).to(logits.device)[None]
    scores = processors(ids, logits[None].float())
    if params.greedy:
        return int(scores.argmax(dim=-1))
    return int(torch.multinomial(scores.softmax(dim=-1), num_samples=1, generator=gen))


def random_params(rng: random.Random, max_tokens: int = 1) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=rng.choice([0.0, 0.0, 0.3, 0.7, 1.0, 1.0, 1.6]),
        top_k=rng.choice([0, 0, 1, 5, 40, 10 ** 6]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.7, 0.2, 1e-4, 1e-9]),  # 1e-9: only the kept last token
        repetition_penalty=rng.choice([1.0, 1.0, 0.6, 1.3, 2.0]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [2, 7, 1000, 4097, 152064])
def test_draw_equals_torch_multinomial(device, vocab):
    """Plain sampling (temperature 1, no filters): each row's token and its generator's state after
    are those of torch.multinomial on that row alone with the same generator."""
    rows = 6
    for trial in range(4 if vocab > 10_000 else 25):
        logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(trial)) * 4).to(device)
        gens = [make_generator(1000 * trial + i, device) for i in range(rows)]
        refs = [copy_of(g) for g in gens]
        params = [SamplingParams(max_tokens=1, temperature=1.0)] * rows
        got = sample_batch(logits, params, gens, [None] * rows).tolist()
        want = [int(torch.multinomial(logits[i:i + 1].softmax(dim=-1), 1, generator=refs[i])) for i in range(rows)]
        assert got == want
        assert all(torch.equal(g.get_state(), r.get_state()) for g, r in zip(gens, refs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [5, 300, 8192])
def test_matches_transformers_processors(device, vocab):
    """Random logits, contexts and sampling controls per row: token for token what transformers'
    RepetitionPenalty / Temperature / TopK / TopP processors and torch.multinomial give one row at a
    time, from the same generator state."""
    rng = random.Random(vocab)
    for trial in range(30):
        rows = rng.randint(1, 9)
        logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(trial)) * rng.choice([1, 3, 8]))
        params = [random_params(rng) for _ in range(rows)]
        contexts = [torch.randint(0, vocab, (rng.randint(1, 40),), generator=torch.Generator().manual_seed(i))
                    if rng.random() < 0.8 else None for i in range(rows)]
        gens = [make_generator(rng.getrandbits(64), device) for _ in range(rows)]
        refs = [copy_of(g) for g in gens]
        got = sample_batch(logits.to(device), params, gens, contexts).tolist()
        want = [hf_reference(logits[i].to(device), params[i], refs[i], contexts[i]) for i in range(rows)]
        assert got == want, (trial, params)
        assert all(torch.equal(g.get_state(), r.get_state()) for g, r in zip(gens, refs))


def test_top_p_cut_at_equality_goes_by_token_id():
    """Four equal scores (probabilities exactly 0.25): top_p 0.75 cuts where the cumulative sum
    equals 1 - top_p, removing one token, the lowest id (transformers' `<=`; a stable sort)."""
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_p=0.75)] * 8
    drawn = set()
    for trial in range(25):
        gens = [make_generator(8 * trial + i) for i in range(8)]
        refs = [copy_of(g) for g in gens]
        got = sample_batch(torch.zeros(8, 4), params, gens, [None] * 8).tolist()
        assert got == [hf_reference(torch.zeros(4), params[0], r, None) for r in refs]
        drawn.update(got)
    assert drawn == {1, 2, 3}


class Stream:
    """A pretend request: its logits at each step come from (its id, the step) only, so whatever runs
    beside it, the same draws must give the same tokens."""

    def __init__(self, key: int, params: SamplingParams, vocab: int):
        self.key, self.params, self.vocab = key, params, vocab
        self.generator = make_generator(params.seed)
        self.context = list(range(key % 7, key % 7 + 5))
        self.tokens: list[int] = []

    def logits(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.key * 100_003 + len(self.tokens))
        return torch.randn(self.vocab, generator=gen) * 3

    def context_ids(self) -> torch.Tensor | None:
        return torch.tensor(self.context + self.tokens) if self.params.repetition_penalty != 1.0 else None


def run_step(streams: list[Stream]) -> None:
    tokens = sample_batch(torch.stack([s.logits() for s in streams]), [s.params for s in streams],
                          [s.generator for s in streams], [s.context_ids() for s in streams]).tolist()
    for s, t in zip(streams, tokens):
        s.tokens.append(t)


def test_seeded_rows_are_batch_invariant():
    """Each seeded stream run alone, then again among changing batches (greedy rows, other seeds,
    other temperatures / top-k / top-p / penalties, at different positions, some steps skipped):
    the same tokens, step for step."""
    vocab, steps = 600, 40
    rng = random.Random(7)
    probes = [SamplingParams(max_tokens=1, temperature=0.9, top_k=50, top_p=0.9, seed=11),
              SamplingParams(max_tokens=1, temperature=1.0, seed=12),
              SamplingParams(max_tokens=1, temperature=0.6, top_p=0.8, repetition_penalty=1.4, seed=13),
              SamplingParams(max_tokens=1, temperature=1.3, top_k=5, repetition_penalty=0.8, seed=14),
              SamplingParams(max_tokens=1)]
    alone = []
    for key, params in enumerate(probes):
        s = Stream(key, params, vocab)
        for _ in range(steps):
            run_step([s])
        alone.append(s.tokens)

    streams = [Stream(key, params, vocab) for key, params in enumerate(probes)]
    others = 100
    while any(len(s.tokens) < steps for s in streams):
        batch = [s for s in streams if len(s.tokens) < steps and rng.random() < 0.7]
        for _ in range(rng.randint(0, 12)):
            params = random_params(rng)
            params.seed = rng.getrandbits(64)
            batch.append(Stream(others, params, vocab))
            others += 1
        rng.shuffle(batch)
        if batch:
            run_step(batch)
    assert [s.tokens for s in streams] == alone
    assert len({tuple(t) for t in alone}) == len(alone)  # the streams are not trivially alike


def test_rows_without_a_distribution_get_no_token():
    vocab = 50
    logits = torch.randn(5, vocab)
    logits[0, 3] = float("nan")        # sampled, NaN
    logits[1, 7] = float("inf")        # sampled, +inf: softmax is NaN (torch.multinomial refuses it)
    logits[2] = -float("inf")          # sampled, no finite score
    logits[3, 9] = float("nan")        # greedy, NaN
    sampled = SamplingParams(max_tokens=1, temperature=1.0, seed=1)
    greedy = SamplingParams(max_tokens=1)
    params = [sampled, sampled, sampled, greedy, greedy]
    tokens = sample_batch(logits, params, [make_generator(i) for i in range(5)], [None] * 5).tolist()
    assert tokens[:4] == [NO_TOKEN] * 4
    assert tokens[4] == int(logits[4].argmax())


def test_logits_are_not_modified():
    logits = torch.randn(3, 40)
    before = logits.clone()
    params = [SamplingParams(max_tokens=1, repetition_penalty=1.5),
              SamplingParams(max_tokens=1, temperature=0.5, top_k=3, top_p=0.5, repetition_penalty=0.5),
              SamplingParams(max_tokens=1)]
    ctx = torch.arange(10)
    sample_batch(logits, params, [make_generator(i) for i in range(3)], [ctx, ctx, None])
    assert torch.equal(logits, before)


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError):
        sample_batch(torch.zeros(2, 5), [SamplingParams(max_tokens=1)], [None], [None])


def test_make_generator():
    a, b = make_generator(5), make_generator(5)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert make_generator(2 ** 64 - 1).initial_seed() == 2 ** 64 - 1
    assert make_generator(None).initial_seed() != make_generator(None).initial_seed()
