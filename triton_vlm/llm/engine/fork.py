"""Several sequences from one prompt (tensorrtllm_backend's `num_return_sequences`, OpenAI's `n`).

A request that asks for n sequences runs as one sequence until its first token is sampled: the
prompt is prefilled once. Then `fork` makes the n - 1 others (a `SequenceGroup` counts them), and
each draws its first token from the same logits row with a generator of its own (seed + its
index where the request is seeded, so sequence i draws what a request seeded seed + i draws).
They hold references to the first sequence's full prompt blocks and compute only the partial last
block, with their first token, before they decode: no KV copy. A decoder with a recurrent state
(linear-attention layers) cannot resume from shared blocks, so there each other sequence
recomputes the prompt.
"""
from __future__ import annotations

from collections import deque

import torch

from triton_vlm.llm.engine.block_manager import BlockManager
from triton_vlm.llm.engine.sampling import make_generator
from triton_vlm.llm.engine.sequence import Sequence
from triton_vlm.llm.engine.streaming import IncrementalDetokenizer


def fork(parent: Sequence, blocks: BlockManager, recurrent: bool, tokenizer, device: torch.device) -> list[Sequence]:
    """The other sequences of `parent`'s request, at its first sampled token (before it is
    appended): each a copy of its prompt, its detokenizer's context and its grammar matcher, with
    its own generator, referencing the parent's full prompt blocks. They are to wait first in line."""
    group = parent.group
    shared = [] if recurrent else parent.blocks[:parent.prompt_len // blocks.block_size]
    seed = parent.params.seed
    children = []
    for index in range(1, group.to_fork + 1):
        blocks.share(shared)
        children.append(Sequence(
            request_id=parent.request_id, prompt_len=parent.prompt_len, tokens=list(parent.tokens),
            embeddings=parent.embeddings, emb_index=parent.emb_index, positions=parent.positions,
            delta=parent.delta, params=parent.params, emit=parent.emit, is_cancelled=parent.is_cancelled,
            generator=make_generator(None if seed is None else seed + index, device),
            detok=IncrementalDetokenizer(tokenizer, parent.detok.ids), arrival=parent.arrival, keys=parent.keys,
            spans=parent.spans, blocks=list(shared), num_computed=len(shared) * blocks.block_size, index=index,
            group=group,
            grammar=None if parent.grammar is None else parent.grammar.fork()))
    group.running += group.to_fork
    group.to_fork = 0
    return children


def with_forks(sampling: list[Sequence], logits: torch.Tensor, blocks: BlockManager, recurrent: bool, tokenizer,
               waiting: deque[Sequence]) -> tuple[list[Sequence], torch.Tensor]:
    """A step's sampling sequences and their logits rows [len(sampling), vocab], with the sequences
    forked off those at their first token (`fork`) added, each with its parent's row, and put
    first in line in `waiting`."""
    rows = list(range(len(sampling)))
    for i, seq in enumerate(list(sampling)):
        if seq.group is not None and seq.group.to_fork:
            children = fork(seq, blocks, recurrent, tokenizer, logits.device)
            waiting.extendleft(reversed(children))
            sampling = sampling + children
            rows += [i] * len(children)
    if len(rows) == len(logits):
        return sampling, logits
    return sampling, logits[torch.tensor(rows, device=logits.device)]
