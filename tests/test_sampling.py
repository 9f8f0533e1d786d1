"""`sample_batch` against transformers' logits processors and `torch.multinomial` (same generator
state, token for token), and its batch invariance."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                                                    NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from triton_vlm.errors import InvalidInput
from triton_vlm.llm.engine.sampling import NO_TOKEN, SamplingParams, make_generator, sample_batch, token_logprobs

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
        return torch.tensor(self.context + self.tokens) if self.params.reads_context else None


def run_step(streams: list[Stream]) -> None:
    tokens = sample_batch(torch.stack([s.logits() for s in streams]), [s.params for s in streams],
                          [s.generator for s in streams], [s.context_ids() for s in streams],
                          [len(s.tokens) for s in streams]).tolist()
    for s, t in zip(streams, tokens):
        s.tokens.append(t)


def alone_and_among_others(probes: list[SamplingParams], vocab: int, steps: int, rng: random.Random,
                           other_params, max_others: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each probe's tokens run alone, and again among changing batches (other rows from
    `other_params(rng, seed)`, at different positions, some steps skipped)."""
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
        for _ in range(rng.randint(0, max_others)):
            batch.append(Stream(others, other_params(rng, others), vocab))
            others += 1
        rng.shuffle(batch)
        if batch:
            run_step(batch)
    return alone, [s.tokens for s in streams]


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

    def other(rng: random.Random, key: int) -> SamplingParams:
        return dataclasses.replace(random_params(rng), seed=rng.getrandbits(64))

    alone, together = alone_and_among_others(probes, vocab, steps, rng, other, 12)
    assert together == alone
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


# ---------------------------------------------------------------------------------------------
# min_tokens, bad words, presence / frequency penalties, log-probabilities
# ---------------------------------------------------------------------------------------------

def openai_penalties(scores: torch.Tensor, generated: torch.Tensor, presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's formula (vLLM's): mu[j] - c[j] * frequency - (c[j] > 0) * presence, c counted over
    the generated ids."""
    counts = torch.bincount(generated.cpu(), minlength=scores.shape[-1]).float().to(scores.device)
    return scores - counts * frequency - (counts > 0).float() * presence


def hf_reference_full(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator, context: torch.Tensor,
                      num_generated: int) -> int:
    """`hf_reference` with transformers' NoBadWords and MinNewTokensLength processors and the OpenAI
    penalties (after the repetition penalty; the masks commute with them)."""
    ids = context.to(logits.device)[None]
    scores = logits[None].float()
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    if num_generated and (params.presence_penalty or params.frequency_penalty):
        scores = openai_penalties(scores, context[len(context) - num_generated:], params.presence_penalty,
                                  params.frequency_penalty)
    processors = LogitsProcessorList()
    if params.bad_word_ids:
        processors.append(NoBadWordsLogitsProcessor([list(w) for w in params.bad_word_ids]))
    if params.min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(len(context) - num_generated, params.min_tokens,
                                                            sorted(params.eos_token_ids), device=logits.device.type))
    scores = processors(ids, scores)
    plain = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k,
                           top_p=params.top_p)
    return hf_reference(scores[0], plain, gen, None)


def random_full_params(rng: random.Random, vocab: int, context: list[int]) -> SamplingParams:
    """Random controls, new ones included; some bad words end with the context's tail so that they bite."""
    words = []
    for _ in range(rng.choice([0, 0, 1, 3])):
        n = rng.randint(1, 3)
        prefix = context[len(context) - n + 1:] if n > 1 and rng.random() < 0.6 else \
            [rng.randrange(vocab) for _ in range(n - 1)]
        words.append((*prefix, rng.randrange(vocab)))
    return SamplingParams(
        max_tokens=8, temperature=rng.choice([0.0, 0.0, 0.7, 1.0]), top_k=rng.choice([0, 0, 5]),
        top_p=rng.choice([1.0, 0.9]), repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5, -1.0, 2.0]), frequency_penalty=rng.choice([0.0, 0.0, 0.3, -2.0]),
        min_tokens=rng.choice([0, 0, 3, 8]), eos_token_ids=frozenset(rng.sample(range(vocab), rng.randint(1, 2))),
        bad_word_ids=tuple(words))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [6, 300, 8192])
def test_new_controls_match_transformers_processors(device, vocab):
    """Token for token what transformers' MinNewTokensLength / NoBadWords / RepetitionPenalty
    processors (and the OpenAI penalty formula) with its warpers and torch.multinomial give."""
    rng = random.Random(1000 + vocab)
    for trial in range(30):
        rows = rng.randint(1, 8)
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(trial)) * rng.choice([1, 4])
        contexts = [torch.randint(0, vocab, (rng.randint(1, 30),), generator=torch.Generator().manual_seed(100 + i))
                    for i in range(rows)]
        generated = [rng.randint(0, len(c)) for c in contexts]
        params = [random_full_params(rng, vocab, c.tolist()) for c in contexts]
        gens = [make_generator(rng.getrandbits(64), device) for _ in range(rows)]
        refs = [copy_of(g) for g in gens]
        got = sample_batch(logits.to(device), params, gens, contexts, generated).tolist()
        want = [hf_reference_full(logits[i].to(device), params[i], refs[i], contexts[i], generated[i])
                for i in range(rows)]
        assert got == want, (trial, params)


def test_min_tokens_masks_eos_until_then_and_bad_words_bite():
    logits = torch.zeros(4, 10)
    logits[:, 3] = 5.0   # eos, the favourite
    logits[:, 7] = 4.0
    eos = frozenset({3})
    params = [SamplingParams(max_tokens=5, min_tokens=2, eos_token_ids=eos),   # 1 generated: masked
              SamplingParams(max_tokens=5, min_tokens=2, eos_token_ids=eos),   # 2 generated: free
              SamplingParams(max_tokens=5, bad_word_ids=((3,), (1, 2, 7))),     # context ends 1, 2: 7 banned too
              SamplingParams(max_tokens=5, bad_word_ids=((9, 2, 7),))]          # context does not end 9, 2
    context = [torch.tensor([5, 1, 2])] * 4
    tokens = sample_batch(logits, params, [None] * 4, context, [1, 2, 0, 0]).tolist()
    assert tokens[0] == 7 and tokens[1] == 3 and tokens[2] not in (3, 7) and tokens[3] == 3


def test_presence_and_frequency_penalties_count_generated_ids_only():
    logits = torch.zeros(1, 5)
    logits[0, 1], logits[0, 2] = 1.0, 0.9
    context = [torch.tensor([1, 1, 1, 2, 2])]   # prompt 1, 1, 1; generated 2, 2
    for presence, frequency, want in ((0.0, 0.0, 1), (0.2, 0.0, 1), (0.0, 0.1, 1), (-0.2, 0.0, 2), (0.0, -0.1, 2)):
        params = [SamplingParams(max_tokens=4, presence_penalty=presence, frequency_penalty=frequency)]
        assert sample_batch(logits, params, [None], context, [2]).tolist() == [want], (presence, frequency)


def test_new_controls_keep_seeded_rows_batch_invariant():
    """Seeded rows with penalties, bad words and min_tokens, alone and among changing batches."""
    vocab, steps = 300, 30
    rng = random.Random(11)

    probes = [dataclasses.replace(random_full_params(random.Random(k), vocab, list(range(5))), temperature=1.0,
                                  seed=50 + k, min_tokens=k % 3 * 4) for k in range(5)]
    alone, together = alone_and_among_others(
        probes, vocab, steps, rng, lambda rng, key: dataclasses.replace(random_full_params(rng, vocab, [0]), seed=key), 8)
    assert together == alone


def test_token_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(4, 50) * 3
    tokens = torch.tensor([3, 10, 0, 49])
    got, top, top_ids = token_logprobs(logits, tokens, [0, 2, 3], top=4)
    logprobs = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(got, logprobs[[0, 2, 3], [3, 0, 49]])
    best = logprobs[[0, 2, 3]].sort(dim=-1, descending=True)
    torch.testing.assert_close(top, best.values[:, :4])
    assert top_ids.tolist() == best.indices[:, :4].tolist()
    assert token_logprobs(logits, tokens, [1])[1].shape == (1, 0)


# ---------------------------------------------------------------------------------------------
# The parser: every input honoured or refused, naming it
# ---------------------------------------------------------------------------------------------

def test_every_input_is_read():
    import numpy as np

    inputs = {"max_tokens": np.array([16], np.int32), "temperature": np.array([0.5], np.float32),
              "top_p": np.array([0.9], np.float32), "top_k": np.array([4], np.int32),
              "random_seed": np.array([7], np.uint64), "stop_words": np.array([b"x"], np.object_),
              "repetition_penalty": np.array([1.1], np.float32), "bad_words": np.array([b"bad", b"w\xff"], np.object_),
              "exclude_input_in_output": np.array([True]), "end_id": np.array([2], np.int32),
              "pad_id": np.array([0], np.int32), "length_penalty": np.array([1.0], np.float32),
              "min_length": np.array([3], np.int32), "presence_penalty": np.array([0.5], np.float32),
              "frequency_penalty": np.array([-0.5], np.float32), "beam_width": np.array([1], np.int32),
              "num_return_sequences": np.array([1], np.int32), "return_log_probs": np.array([True]),
              "return_context_logits": np.array([False]), "return_generation_logits": np.array([False]),
              "return_perf_metrics": np.array([False]), "return_num_input_tokens": np.array([False]),
              "return_num_output_tokens": np.array([True]), "stream": np.array([True]), "text_input": "ignored"}
    p = SamplingParams.from_inputs(inputs)
    assert (p.max_tokens, p.top_k, p.seed, p.min_tokens, p.end_id, p.pad_id) == (16, 4, 7, 3, 2, 0)
    assert (p.temperature, p.top_p, p.presence_penalty, p.frequency_penalty) == pytest.approx((0.5, 0.9, 0.5, -0.5))
    assert p.repetition_penalty == pytest.approx(1.1)
    assert p.stop_words == ["x"] and p.bad_words == ["bad", "w\ufffd"]
    assert (p.return_log_probs, p.return_num_input_tokens, p.return_num_output_tokens) == (True, False, True)
    assert SamplingParams.from_inputs({"max_tokens": 4, "seed": 7, "random_seed": 7}).seed == 7
    assert SamplingParams.from_inputs({"max_tokens": 4, "min_tokens": 2}).min_tokens == 2
    defaults = SamplingParams.from_inputs({"max_tokens": 4})
    assert (defaults.return_log_probs, defaults.return_num_input_tokens, defaults.min_tokens) == (False, True, 0)


REFUSED = {
    "exclude_input_in_output": (False, "exclude_input_in_output: false is not supported (outputs never include "
                                       "the prompt); send true or leave it out"),
    "beam_width": (4, "beam_width: 4 is not supported (no beam search); send 1 or leave it out"),
    "length_penalty": (0.5, "length_penalty: 0.5 is not supported (it applies to beam search"),
    "num_return_sequences": (17, "num_return_sequences: must be in [1, 16] (max_return_sequences=16), got 17"),
    "num_top_log_probs": (21, "num_top_log_probs: must be in [0, 20] (max_top_log_probs=20), got 21"),
    "return_context_logits": (True, "return_context_logits: true is not supported"),
    "return_generation_logits": (True, "return_generation_logits: true is not supported"),
    "return_perf_metrics": (True, "return_perf_metrics: true is not supported"),
    "min_tokens": (20, "min_tokens: must be in [0, max_tokens=16], got 20"),
    "min_length": (-1, "min_length: must be in [0, max_tokens=16], got -1"),
    "presence_penalty": (2.5, "presence_penalty: must be in [-2, 2], got 2.5"),
    "frequency_penalty": (-3.0, "frequency_penalty: must be in [-2, 2], got -3.0"),
    "end_id": (-1, "end_id: must be a token id >= 0, got -1"),
    "pad_id": (-5, "pad_id: must be a token id >= 0, got -5"),
    "bad_words": ([b""], "bad_words[0]: must be a non-empty string"),
    "return_log_probs": (1, "return_log_probs: must be true or false, got 1"),
    "return_num_input_tokens": (0, "return_num_input_tokens: must be true or false, got 0"),
    "random_seed": (-1, "random_seed: must be an integer in"),
    "embedding_bias": ([0.0, float("inf")], "embedding_bias: must be finite numbers"),
}


def test_a_guide_past_its_limit_is_refused_naming_it():
    from triton_vlm.contract.sampling import MAX_GUIDE_CHARS

    guide = "a" * (MAX_GUIDE_CHARS + 1)
    with pytest.raises(InvalidInput, match=rf"^guided_decoding_guide: {len(guide)} characters exceed "
                                           rf"max_guide_chars={MAX_GUIDE_CHARS}$"):
        SamplingParams(max_tokens=4, guide_type="regex", guide=guide)
    assert SamplingParams(max_tokens=4, guide_type="regex", guide=guide[1:]).guide == guide[1:]


@pytest.mark.parametrize("name", REFUSED)
def test_refusals_name_the_input_and_the_value(name):
    value, message = REFUSED[name]
    with pytest.raises(InvalidInput) as error:
        SamplingParams.from_inputs({"max_tokens": 16, name: value})
    assert str(error.value).startswith(message)


def test_an_old_name_and_the_new_one_must_agree():
    with pytest.raises(InvalidInput, match="min_length: the old name of min_tokens, both set, to 3 and 2"):
        SamplingParams.from_inputs({"max_tokens": 16, "min_tokens": 2, "min_length": 3})


def test_for_model_resolves_token_ids():
    words = {"ab": [5, 6], "c": [7], "nothing": []}
    p = SamplingParams(max_tokens=4, bad_words=["ab", "c", "nothing"]).for_model(10, [1, 2], words.__getitem__)
    assert p.eos_token_ids == {1, 2} and p.bad_word_ids == ((5, 6), (7,)) and p.bad_words == ["ab", "c", "nothing"]
    assert SamplingParams(max_tokens=4, end_id=9).for_model(10, [1, 2], words.__getitem__).eos_token_ids == {9}
    for name in ("end_id", "pad_id"):
        with pytest.raises(InvalidInput, match=rf"{name}: must be a token id in \[0, 10\), got 10"):
            SamplingParams(max_tokens=4, **{name: 10}).for_model(10, [1], words.__getitem__)


def test_embedding_bias_is_transformers_sequence_bias_first_and_keeps_the_raw_logits():
    """A row's `embedding_bias` (OpenAI's `logit_bias`) adds to its scores as transformers'
    `SequenceBiasLogitsProcessor` does for single tokens, before the penalties; other rows and the
    logits themselves are untouched; its length must be the model's vocabulary (`for_model`)."""
    import numpy as np
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    raw = logits.clone()
    bias = np.zeros(50, np.float32)
    bias[[3, 7]] = [100.0, -5.0]
    params = [SamplingParams(max_tokens=4, embedding_bias=bias), SamplingParams(max_tokens=4)]
    tokens = sample_batch(logits, params, [None, None], [None, None])
    hf = SequenceBiasLogitsProcessor({(3,): 100.0, (7,): -5.0})(torch.zeros(1, 1, dtype=torch.long), raw[:1].clone())
    assert tokens.tolist() == [int(hf.argmax()), int(raw[1].argmax())] and tokens[0] == 3
    assert torch.equal(logits, raw)
    ids = torch.tensor([3, 3, 3])
    penalized = SamplingParams(max_tokens=4, embedding_bias=bias, repetition_penalty=2.0)
    hf = RepetitionPenaltyLogitsProcessor(2.0)(ids[None], SequenceBiasLogitsProcessor({(3,): 100.0, (7,): -5.0})(
        ids[None], raw[:1].clone()))
    assert sample_batch(raw[:1].clone(), [penalized], [None], [ids]).tolist() == [int(hf.argmax())]
    with pytest.raises(InvalidInput, match=r"embedding_bias: 50 values; one per token of the model's vocabulary, 60"):
        SamplingParams.from_inputs({"max_tokens": 4, "embedding_bias": bias}).for_model(60, [1], lambda w: [])
    assert SamplingParams.from_inputs({"max_tokens": 4, "embedding_bias": np.zeros(0, np.float32)}).embedding_bias is None
