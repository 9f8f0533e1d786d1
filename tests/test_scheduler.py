"""The block manager and the scheduler on token lists alone: no checkpoint, no tensors of a model."""
from __future__ import annotations

import random

import pytest
import torch

from triton_vlm.llm.engine.block_manager import BlockManager
from triton_vlm.llm.engine.sampling import SamplingParams
from triton_vlm.llm.engine.scheduler import Scheduler
from triton_vlm.llm.engine.sequence import Sequence


def make_seq(name: str, prompt_len: int, arrival: int, max_tokens: int = 8, keys: list[bytes] | None = None,
             queued_since: float | None = None) -> Sequence:
    return Sequence(request_id=name, prompt_len=prompt_len, tokens=list(range(prompt_len)), embeddings=None,
                    emb_index=None, positions=torch.zeros(3, prompt_len, dtype=torch.long), delta=0,
                    params=SamplingParams(max_tokens=max_tokens), emit=lambda out: None, is_cancelled=lambda: False,
                    generator=None, detok=None, arrival=arrival, keys=list(keys or []), queued_since=queued_since)


def run_step(sched: Scheduler):
    """One step as the engine runs it: plan, "forward", and a token for every chunk that samples."""
    out = sched.schedule()
    sched.advance(out)
    for c in out.chunks:
        if c.samples:
            c.seq.tokens.append(0)
    return out


# ---- block manager -------------------------------------------------------------------------------

def test_allocate_release_and_refcounts():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_used == 3 and bm.num_free == 1
    assert bm.allocate(2) is None and bm.num_free == 1  # all or nothing
    bm.release(a)
    assert bm.num_free == 4
    with pytest.raises(RuntimeError, match="released twice"):
        bm.release(a[:1])


def test_prefix_blocks_are_shared_then_evicted_lru():
    bm = BlockManager(num_blocks=3, block_size=2, prefix_caching=True)
    first = bm.allocate(2)
    bm.register(first[0], b"k0")
    bm.register(first[1], b"k1")
    shared = bm.lookup([b"k0", b"k1", b"k2"])  # the longest cached prefix, now referenced twice
    assert shared == first and bm.hits == 2
    bm.release(first)
    assert bm.num_used == 2  # still held by the second sequence
    bm.release(shared)
    assert bm.num_free == 3  # cached blocks count as free
    assert bm.lookup([b"k0"]) == [first[0]]  # still keyed
    bm.release([first[0]])
    # the never-keyed block goes first, then the least recently released keyed one
    assert bm.allocate(2) == [b for b in range(3) if b not in first] + [first[1]]
    assert bm.lookup([b"k1"]) == [] and bm.lookup([b"k0"]) == [first[0]]


def test_state_slots_lowest_first():
    bm = BlockManager(num_blocks=1, block_size=1, state_slots=3)
    assert [bm.allocate_state() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="all 3"):
        bm.allocate_state()
    bm.release_state(1)
    bm.release_state(0)
    assert bm.allocate_state() == 0 and bm.num_states_used == 2
    with pytest.raises(RuntimeError, match="not in use"):
        bm.release_state(1)


# ---- scheduler ------------------------------------------------------------------------------------

def test_prefill_is_chunked_to_the_budget_and_decodes_join():
    sched = Scheduler(BlockManager(64, 4), max_num_tokens=16)
    a = make_seq("a", 20, 1)
    sched.add(a)
    out = run_step(sched)
    assert [(c.seq.request_id, c.start, c.end) for c in out.chunks] == [("a", 0, 16)]
    b = make_seq("b", 30, 2)
    sched.add(b)
    out = run_step(sched)  # a finishes its prompt (4 rows, samples), b takes the remaining 12
    assert [(c.seq.request_id, c.start, c.end, c.samples) for c in out.chunks] == [("a", 16, 20, True),
                                                                                ("b", 0, 12, False)]
    out = run_step(sched)  # a decodes one row; b continues its prompt
    assert [(c.seq.request_id, c.start, c.end) for c in out.chunks] == [("a", 20, 21), ("b", 12, 27)]
    assert out.num_tokens <= 16
    assert len(a.blocks) == sched.blocks.blocks_for(21) and len(b.blocks) == sched.blocks.blocks_for(27)


def test_without_mixed_steps_prompt_chunks_and_decodes_run_apart():
    """The same arrivals as above: b's prompt runs in steps of its own while a waits to decode,
    then a decodes alone once no prompt work is left."""
    sched = Scheduler(BlockManager(64, 4), max_num_tokens=16, mixed_steps=False)
    a = make_seq("a", 20, 1)
    sched.add(a)
    assert [(c.seq.request_id, c.start, c.end) for c in run_step(sched).chunks] == [("a", 0, 16)]
    b = make_seq("b", 30, 2)
    sched.add(b)
    out = run_step(sched)  # a's last prompt rows and b's first: prompt work only
    assert [(c.seq.request_id, c.start, c.end, c.samples) for c in out.chunks] == [("a", 16, 20, True),
                                                                                ("b", 0, 12, False)]
    out = run_step(sched)  # b's prompt goes on; a, decoding, waits
    assert [(c.seq.request_id, c.start, c.end) for c in out.chunks] == [("b", 12, 28)]
    out = run_step(sched)
    assert [(c.seq.request_id, c.start, c.end, c.samples) for c in out.chunks] == [("b", 28, 30, True)]
    out = run_step(sched)  # no prompt work left: both decode
    assert [(c.seq.request_id, c.start, c.end) for c in out.chunks] == [("a", 20, 21), ("b", 30, 31)]
    assert all(c.is_decode for c in out.chunks)


def test_max_running_keeps_the_rest_waiting_in_order():
    sched = Scheduler(BlockManager(64, 4), max_running=2, max_num_tokens=100)
    seqs = [make_seq(str(i), 4, i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = run_step(sched)
    assert [c.seq.request_id for c in out.chunks] == ["0", "1"]
    assert list(sched.waiting) == seqs[2:] and not seqs[2].blocks
    sched.finish(seqs[0])
    out = run_step(sched)
    assert [c.seq.request_id for c in out.chunks] == ["1", "2"]


def test_out_of_blocks_preempts_the_newest_and_it_resumes_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_tokens=64)
    old, new = make_seq("old", 8, 1), make_seq("new", 7, 2)
    sched.add(old)
    sched.add(new)
    run_step(sched)  # 2 + 2 blocks: the pool is full
    assert bm.num_free == 0
    out = run_step(sched)  # old needs a third block for token 8: new is preempted
    assert out.preempted == [new] and sched.num_preempted == 1
    assert [c.seq.request_id for c in out.chunks] == ["old"]
    assert not new.blocks and new.num_computed == 0 and sched.waiting[0] is new
    assert new.tokens == list(range(7)) + [0]  # its token so far is kept; it is recomputed
    sched.finish(old)
    out = run_step(sched)  # recompute: the prompt and the generated token in one chunk
    assert [(c.seq.request_id, c.start, c.end, c.samples) for c in out.chunks] == [("new", 0, 8, True)]


def test_a_waiting_request_without_blocks_waits_and_takes_none():
    bm = BlockManager(num_blocks=2, block_size=4)
    sched = Scheduler(bm, max_num_tokens=64)
    a, b = make_seq("a", 4, 1), make_seq("b", 8, 2)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    out = run_step(sched)  # a takes the second block for its token 4; b needs two and waits
    assert [c.seq for c in out.chunks] == [a] and out.preempted == []
    assert sched.waiting[0] is b and not b.blocks and bm.num_free == 0


def test_queue_timeout_lists_only_requests_that_never_ran():
    now = [0.0]
    bm = BlockManager(num_blocks=2, block_size=4)
    sched = Scheduler(bm, max_num_tokens=64, max_running=1, queue_timeout_ms=100, clock=lambda: now[0])
    a, b = make_seq("a", 4, 1, queued_since=0.0), make_seq("b", 4, 2, queued_since=0.0)
    sched.add(a)
    sched.add(b)
    assert run_step(sched).overdue == []
    now[0] = 0.2
    out = run_step(sched)
    assert [(s.request_id, round(ms)) for s, ms in out.overdue] == [("b", 200)]
    assert a.queued_since is None  # had its place: never overdue, preempted or not


def test_prefix_cache_hit_skips_computed_blocks_but_not_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4, prefix_caching=True)
    sched = Scheduler(bm, max_num_tokens=64)
    keys = [b"p0", b"p1", b"p2"]
    first = make_seq("first", 12, 1, keys=keys)
    sched.add(first)
    run_step(sched)  # prompt blocks registered once computed
    second = make_seq("second", 12, 2, keys=keys)
    sched.add(second)
    out = run_step(sched)
    chunk = next(c for c in out.chunks if c.seq is second)
    # 2 of 3 blocks reused: a fully cached prompt still computes its last block for its logits
    assert (chunk.start, chunk.end) == (8, 12) and second.blocks[:2] == first.blocks[:2] and bm.hits == 2


@pytest.mark.parametrize("mixed_steps", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_random_workload_returns_every_block_and_slot(seed, mixed_steps):
    """Random arrivals, lengths, cancellations and a pool small enough to preempt: every step stays
    within the budget, no block has two owners (without prefix caching), and once everything has
    finished or been cancelled every block and state slot is free. Without mixed steps no step holds
    both prompt work and a decode (`ScheduledChunk.is_decode`, what a CUDA graph replays)."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=12, block_size=4, state_slots=4)
    sched = Scheduler(bm, max_running=4, max_num_tokens=24, recurrent=True, mixed_steps=mixed_steps)
    pending = [make_seq(f"s{i}", rng.randint(1, 30), i, max_tokens=rng.randint(1, 10)) for i in range(25)]
    finished = 0
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        out = run_step(sched)
        assert out.num_tokens <= 24 and len(sched.running) <= 4
        kinds = {c.is_decode for c in out.chunks}
        assert mixed_steps or len(kinds) <= 1, [(c.seq.request_id, c.start, c.end) for c in out.chunks]
        owners = [b for s in sched.running for b in s.blocks]
        assert len(owners) == len(set(owners)) == bm.num_used
        assert sorted(s.state for s in sched.running) == sorted(bm._used_states)
        for s in list(sched.running) + list(sched.waiting):
            if s.num_generated >= s.params.max_tokens or rng.random() < 0.03:
                sched.finish(s)
                finished += 1
        if not pending and not sched:
            break
    assert finished == 25 and not sched and sched.num_preempted > 0  # the pool was tight enough to preempt
    assert bm.num_free == bm.num_blocks and bm.num_states_used == 0
