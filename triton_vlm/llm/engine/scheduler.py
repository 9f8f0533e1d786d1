"""The step planner of the in-flight batch: which sequences run which rows in the next forward pass.

Every step, oldest request first, `Scheduler.schedule`:
- gives each running sequence its next rows within a per-step token budget (`max_num_tokens`):
  one token for a decoding sequence, the next chunk of the prompt for one still in prefill;
- admits waiting requests into the remaining budget (they join the running batch right away),
  reusing cached prompt-prefix blocks when prefix caching is on;
- never ends a prompt chunk inside a bidirectional span (`chunk_end`: a media block whose tokens
  see each other), so every row of a span has its whole span in its step or before;
- takes KV blocks from the block manager as rows need them. When it is out of blocks, a waiting
  request keeps waiting, and a running one that needs a block preempts the newest running sequence
  (its blocks go back; it is recomputed later from its prompt and the tokens it already has, with
  its sampler state kept, so its output does not change). Nothing fails for lack of blocks;
- with `queue_timeout_ms`, lists the requests still waiting for their first place in the batch
  after that long (`SchedulerOutput.overdue`: the engine ends them with "rejected"). A preempted
  request has had its place and is never rejected.
Sequences of decoders with a recurrent state take a state slot when they start running and give it
back with their blocks. No tensors and no model here: it is tested on token lists alone.

With `mixed_steps` off a step holds prompt chunks or decodes, never both (nano-vllm, and SGLang
without `--enable-mixed-chunk`): prompt work first, and a step of the running sequences' decodes
when there is none (or none could get blocks). On CUDA a step with a prompt chunk runs eagerly and
a decode-only one replays a CUDA graph: mixed, nearly every step under a closed-loop load holds a
new prompt's chunk and runs eagerly.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from triton_vlm.llm.engine.block_manager import BlockManager
from triton_vlm.llm.engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens `start .. end` of `seq` run in this step; `samples`: the chunk reaches the sequence's
    last token, so its last row's logits give the next token."""
    seq: Sequence
    start: int
    end: int
    samples: bool

    @classmethod
    def of(cls, seq: Sequence, end: int) -> "ScheduledChunk":
        """The sequence's next rows, from its first token without K/V up to `end`."""
        return cls(seq, seq.num_computed, end, end == len(seq.tokens))

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def is_decode(self) -> bool:
        """One generated token's row, sampling the next: the rows a CUDA graph replays."""
        return self.num_tokens == 1 and self.start >= self.seq.prompt_len and self.samples


def chunk_end(seq: Sequence, end: int) -> int:
    """`end`, unless it would cut one of the sequence's bidirectional spans (whose tokens all see
    each other: a chunk holds the whole rest of one): then the span's start, or where the chunk
    starts inside the span (a prefix-cache hit), the span's end, past the step's budget."""
    if not seq.spans or seq.num_computed >= seq.spans[-1][1]:  # (in order: a decode has them all behind it)
        return end
    for a, b in seq.spans:
        if a < end < b:
            return a if a > seq.num_computed else b
    return end


def decoding(seq: Sequence) -> bool:
    """Whether `seq`'s next row is a decode (`ScheduledChunk.is_decode`), not prompt work."""
    return seq.num_computed >= seq.prompt_len and len(seq.tokens) - seq.num_computed == 1


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)   # running order (oldest first)
    preempted: list[Sequence] = field(default_factory=list)
    overdue: list[tuple[Sequence, float]] = field(default_factory=list)  # (sequence, ms waited)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_running: int = 64, max_num_tokens: int = 512,
                 recurrent: bool = False, queue_timeout_ms: float = 0.0, mixed_steps: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        if queue_timeout_ms < 0:
            raise ValueError(f"queue_timeout_ms must be >= 0, got {queue_timeout_ms}")
        self.blocks = blocks
        self.max_running = max(1, int(max_running))
        self.max_num_tokens = max(1, int(max_num_tokens))
        self.recurrent = recurrent
        self.queue_timeout_ms = float(queue_timeout_ms)
        self.mixed_steps = mixed_steps
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # arrival order
        self.num_preempted = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """The sequence leaves the batch (or the queue): its blocks and state slot go back."""
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.mixed_steps:
            self._plan(out, lambda seq: True, admit=True)
        else:
            self._plan(out, lambda seq: not decoding(seq), admit=True)
            if not out.chunks:  # no prompt work (or none got blocks): the decodes
                self._plan(out, lambda seq: True, admit=False)
        out.chunks.sort(key=lambda c: c.seq.arrival)
        if self.queue_timeout_ms:
            out.overdue = self._overdue()
        return out

    def _plan(self, out: SchedulerOutput, takes: Callable[[Sequence], bool], admit: bool) -> None:
        """Into `out`: the next rows of the running sequences that `takes` (oldest first), then,
        with `admit`, waiting requests, within the step's token budget."""
        budget = self.max_num_tokens
        planned: set[Sequence] = set()
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq not in self.running or not takes(seq):  # preempted meanwhile, or not this step's kind
                continue
            end = chunk_end(seq, min(len(seq.tokens), seq.num_computed + budget))
            if self._grow(seq, end, planned, out):
                out.chunks.append(ScheduledChunk.of(seq, end))
                planned.add(seq)
                budget -= end - seq.num_computed
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            fresh = not seq.blocks
            if fresh and seq.keys:  # reuse cached prompt blocks; at least one token is computed
                seq.blocks = self.blocks.lookup(seq.keys[:(len(seq.tokens) - 1) // self.blocks.block_size])
                seq.num_computed = len(seq.blocks) * self.blocks.block_size
            end = chunk_end(seq, min(len(seq.tokens), seq.num_computed + budget))
            got = self.blocks.allocate(self.blocks.blocks_for(end) - len(seq.blocks))
            if got is None:  # out of blocks: it keeps waiting, first in line
                if fresh:
                    self.blocks.release(seq.blocks)
                    seq.blocks, seq.num_computed = [], 0
                break
            seq.blocks.extend(got)
            seq.queued_since = None
            if self.recurrent:  # running sequences <= max_running = state slots
                seq.state = self.blocks.allocate_state()
            self.waiting.popleft()
            self.running.append(seq)
            self.running.sort(key=lambda s: s.arrival)
            out.chunks.append(ScheduledChunk.of(seq, end))
            planned.add(seq)
            budget -= end - seq.num_computed

    def advance(self, out: SchedulerOutput) -> None:
        """After the step's forward pass: its rows' K/V are in the blocks; newly completed prompt
        blocks become reusable."""
        bs = self.blocks.block_size
        for c in out.chunks:
            seq = c.seq
            seq.num_computed = c.end
            for j in range(c.start // bs, min(c.end, seq.prompt_len) // bs) if seq.keys else ():
                self.blocks.register(seq.blocks[j], seq.keys[j])

    def _overdue(self) -> list[tuple[Sequence, float]]:
        now = self.clock()
        waited = [(s, (now - s.queued_since) * 1000.0) for s in self.waiting if s.queued_since is not None]
        return [(s, ms) for s, ms in waited if ms > self.queue_timeout_ms]

    def _release(self, seq: Sequence) -> None:
        if seq.blocks:
            self.blocks.release(seq.blocks)
            seq.blocks = []
        if seq.state is not None:
            self.blocks.release_state(seq.state)
            seq.state = None

    def _preempt(self, seq: Sequence) -> None:
        """Blocks and state slot back; the sequence waits (first in line) to be recomputed."""
        self._release(seq)
        seq.num_computed = 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preempted += 1

    def _grow(self, seq: Sequence, end: int, planned: set[Sequence], out: SchedulerOutput) -> bool:
        """Blocks for tokens up to `end`, preempting the newest unplanned running sequence as
        needed; False if `seq` itself had to be preempted."""
        need = self.blocks.blocks_for(end) - len(seq.blocks)
        while need > 0:
            got = self.blocks.allocate(need)
            if got is not None:
                seq.blocks.extend(got)
                return True
            victim = next((s for s in reversed(self.running) if s not in planned), seq)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True
