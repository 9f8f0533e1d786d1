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
    blocks: list[int] = field(default_factory=list)   # block table
    state: int | None = None          # recurrent-state slot while running
    num_computed: int = 0             # tokens whose K/V are in the blocks
    queued_since: float | None = None  # submit time; None from its first place in the batch on (preempted too)
    # a guided request's matcher (`grammar.py`), advanced by each generated token; kept when preempted
    grammar: "xgrammar.GrammarMatcher | None" = None
    text: str = ""   # stable detokenized text so far
    sent: int = 0    # characters of `text` emitted
    done: bool = False

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len
