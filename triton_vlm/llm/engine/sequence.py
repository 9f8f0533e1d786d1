"""One request inside the engine, from submit to its final emit."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    import xgrammar

    from triton_vlm.llm.engine.sampling import SamplingParams
    from triton_vlm.llm.engine.streaming import GenerationOutput, IncrementalDetokenizer


@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one request that asks for `num_return_sequences` > 1. Its first sequence
    prefills the prompt; its first sampled token's logits row is also the others' (`Engine._fork`),
    which share its full prompt blocks and recompute only the partial last one."""
    to_fork: int      # sequences still to fork off the first: n - 1 until its first token, then 0
    running: int = 1  # sequences not finished yet

    def leave(self) -> bool:
        """A sequence finished; whether it was the last. One that ends before its first token
        (cancelled, refused) forks none."""
        self.running -= 1
        self.to_fork = 0
        return self.running == 0


@dataclass(eq=False)
class Sequence:
    """The scheduler owns `blocks`, `state`, `num_computed` and `queued_since`; the runner reads the
    inputs (`tokens`, `embeddings`, `positions`, ...) and the block table; the output processor owns
    the text fields and `done`."""
    request_id: str
    prompt_len: int
    tokens: list[int]                 # prompt ids, then generated ids
    embeddings: torch.Tensor | None   # placeholder rows, in the model dtype (kept for recompute)
    emb_index: torch.Tensor | None    # per prompt position: row of `embeddings`, or -1
    positions: torch.Tensor           # [3, prompt_len]
    delta: int                        # decode position = token index + delta
    params: "SamplingParams"
    emit: Callable[["GenerationOutput"], None]
    is_cancelled: Callable[[], bool] | None   # asked before every step, where given
    generator: torch.Generator
    detok: "IncrementalDetokenizer"
    arrival: int = 0
    keys: list[bytes] = field(default_factory=list)   # prefix-cache keys of full prompt blocks
    # prompt token ranges [a, b) attending to each other both ways in prefill (`media_spans`)
    spans: tuple[tuple[int, int], ...] = ()
    blocks: list[int] = field(default_factory=list)   # block table
    state: int | None = None          # recurrent-state slot while running
    num_computed: int = 0             # tokens whose K/V are in the blocks
    queued_since: float | None = None  # submit time; None from its first place in the batch on (preempted too)
    # a guided request's matcher (`grammar.py`), advanced by each generated token; kept when preempted
    grammar: "xgrammar.GrammarMatcher | None" = None
    index: int = 0   # its `sequence_index` among the request's sequences
    group: SequenceGroup | None = None  # with num_return_sequences > 1
    text: str = ""   # stable detokenized text so far
    sent: int = 0    # characters of `text` emitted
    done: bool = False

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len
