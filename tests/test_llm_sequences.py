"""Top log-probabilities and several sequences per request (`num_return_sequences`) in the `llm`
engine, against transformers' Qwen2.5-VL (tiny random checkpoint) and against the engine's own
single-sequence requests."""
from __future__ import annotations

import threading

import pytest
import torch

from tests.test_llm import PROMPTS, TIMEOUT, Collector, ckpt, hf, hf_greedy_with_logits, media, requests, submit  # noqa: F401
from triton_vlm.llm import Engine, GenerationOutput, SamplingParams


@pytest.fixture(scope="module")
def engine(ckpt):  # noqa: F811
    eng = Engine(ckpt, kv_cache_tokens=4096, block_size=8, max_num_tokens=512)
    yield eng
    eng.shutdown()


class Sequences:
    """The outputs of one request by sequence index; done at the request's last output."""

    def __init__(self):
        self.outputs: dict[int, list[GenerationOutput]] = {}
        self.finals = 0
        self.done = threading.Event()

    def __call__(self, out: GenerationOutput) -> None:
        assert not self.done.is_set(), "an output after the request's last"
        self.outputs.setdefault(out.sequence_index, []).append(out)
        self.finals += out.request_finished
        if out.request_finished:
            self.done.set()

    def wait(self) -> "Sequences":
        assert self.done.wait(TIMEOUT), "the request never ended"
        return self

    def ids(self, index: int) -> list[int]:
        return [t for o in self.outputs[index] for t in o.token_ids]


def test_top_logprobs_are_transformers_log_softmax(hf, engine, requests):
    """Each step's top-k tokens and log-probabilities are the log_softmax of transformers' logits at
    that step (to 1e-4), most likely first; the chosen token's is among them (greedy: the first)."""
    model, _ = hf
    req = requests["image"]
    expected, logits = hf_greedy_with_logits(model, req, 6)
    col = submit(engine, req, SamplingParams(max_tokens=6, return_log_probs=True, num_top_log_probs=5),
                 "top-5").wait()
    assert col.ids == expected
    steps = [p for o in col.outputs for p in o.logprobs]
    assert len(steps) == len(expected)
    for step, ref, token in zip(steps, logits, expected):
        best = torch.log_softmax(ref[0].float(), -1).topk(5)
        assert step.top_ids == best.indices.tolist()
        assert step.top_logprobs == pytest.approx(best.values.tolist(), abs=1e-4)
        assert step.top_ids[0] == token and step.logprob == pytest.approx(step.top_logprobs[0], abs=1e-6)
    plain = submit(engine, req, SamplingParams(max_tokens=2, return_log_probs=True), "top-0").wait()
    assert all(p.top_ids == [] for o in plain.outputs for p in o.logprobs)


@pytest.mark.parametrize("name", ["text", "image"])
def test_greedy_sequences_each_equal_one_request(engine, requests, name):
    req = requests[name]
    alone = submit(engine, req, SamplingParams(max_tokens=8), f"alone-{name}").wait().ids
    group = Sequences()
    engine.submit(f"n3-{name}", **req["llm"], params=SamplingParams(max_tokens=8, num_return_sequences=3), emit=group)
    group.wait()
    assert sorted(group.outputs) == [0, 1, 2] and group.finals == 1
    assert [group.ids(i) for i in range(3)] == [alone] * 3
    assert engine.kv_blocks_used == 0


def test_seeded_sequences_draw_as_seed_plus_index_and_prefill_once(engine, requests):
    """Sequence i of a request seeded s draws what one request seeded s + i draws. The prompt is
    prefilled once: the other sequences compute only its partial last block (with their first
    token) before decoding, which the rows the engine ran show."""
    req = requests["image"]
    params = dict(max_tokens=6, temperature=1.0, top_k=50)
    alone = [submit(engine, req, SamplingParams(seed=40 + i, **params), f"seed-{i}").wait().ids for i in range(3)]
    assert len({tuple(a) for a in alone}) > 1  # the seeds draw differently
    rows = []
    forward = engine.runner.forward
    engine.runner.forward = lambda chunks: (rows.append(sum(c.num_tokens for c in chunks)), forward(chunks))[1]
    try:
        group = Sequences()
        engine.submit("seeded-n3", **req["llm"], params=SamplingParams(seed=40, num_return_sequences=3, **params),
                      emit=group)
        group.wait()
    finally:
        engine.runner.forward = forward
    assert [group.ids(i) for i in range(3)] == alone
    prompt, bs, m = len(req["llm"]["input_ids"]), engine.blocks.block_size, params["max_tokens"]
    assert sum(rows) == prompt + (m - 1) + 2 * (prompt % bs + m - 1)
    assert engine.kv_blocks_used == 0


def test_cancelling_a_request_ends_every_sequence(engine, requests):
    group = Sequences()
    engine.submit("cancel-n4", **requests["text"]["llm"], params=SamplingParams(max_tokens=200, num_return_sequences=4),
                  emit=group, is_cancelled=lambda: sum(len(v) for v in group.outputs.values()) >= 6)
    group.wait()
    assert group.finals == 1 and sorted(group.outputs) == [0, 1, 2, 3]
    assert {o[-1].finish_reason for o in group.outputs.values()} == {"cancelled"}
    assert engine.kv_blocks_used == 0


def test_one_token_sequences_end_together(engine, requests):
    """max_tokens 1: every sequence ends on the token drawn from the shared prefill."""
    group = Sequences()
    engine.submit("n2-one", **requests["text"]["llm"], params=SamplingParams(max_tokens=1, num_return_sequences=2),
                  emit=group)
    group.wait()
    assert [len(group.ids(i)) for i in range(2)] == [1, 1] and group.finals == 1
    assert engine.kv_blocks_used == 0


def test_guided_sequences_each_follow_the_grammar(engine, requests):
    """Each sequence has its own matcher (forked from the first's): every sampled answer matches."""
    import re

    group = Sequences()
    engine.submit("guided-n3", **requests["text"]["llm"], emit=group,
                  params=SamplingParams(max_tokens=12, temperature=1.0, seed=3, num_return_sequences=3,
                                        guide_type="regex", guide="(yes|no), [a-z]{2,5}"))
    group.wait()
    texts = ["".join(o.text for o in group.outputs[i]) for i in range(3)]
    assert all(re.fullmatch("(yes|no), [a-z]{2,5}", t) for t in texts), texts
    assert all(group.outputs[i][-1].finish_reason == "stop" for i in range(3))
