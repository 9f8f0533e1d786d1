"""The output processor: sampled ids become streamed text, stop words and finish reasons.

Each request gets exactly one final emit (`finish_reason` set): on stop, length, cancel, shutdown,
queue timeout ("rejected"), or an error ("error"; both with `error` set). `release` (the engine's:
blocks and state back, request id free) runs before that final emit, so a client that sees the end
of its request can count on the KV blocks being back.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from triton_vlm.llm.engine.sequence import Sequence
from triton_vlm.llm.engine.streaming import GenerationOutput, TokenLogprobs

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, release: Callable[[Sequence], None]):
        self.release = release
        self.num_generated_tokens = 0

    def on_token(self, seq: Sequence, token: int, logits: torch.Tensor | None = None,
                 logprob: TokenLogprobs | None = None) -> None:
        """Append a sampled token: emit its text, or finish the request (eos, stop word, length)."""
        seq.tokens.append(token)
        self.num_generated_tokens += 1
        seq.text += seq.detok.add(token)
        logprobs = None if logprob is None else [logprob]
        reason, stop_word_at = None, None
        if token in seq.params.eos_token_ids:
            reason = "stop"
        if seq.params.stop_words:
            start = max(0, seq.sent - max(len(w) for w in seq.params.stop_words))
            hits = [i for i in (seq.text.find(w, start) for w in seq.params.stop_words) if i >= 0]
            if hits:
                reason, stop_word_at = "stop", min(hits)
        if reason is None and seq.num_generated >= seq.params.max_tokens:
            reason = "length"
        if reason is None:
            end = max(seq.sent, len(seq.text) - self._held_back(seq))
            text, seq.sent = seq.text[seq.sent:end], end
            self._emit(seq, GenerationOutput([token], text, logits=logits, logprobs=logprobs))
            return
        if stop_word_at is None:
            seq.text += seq.detok.flush()
        self.finish(seq, reason, token_ids=[token], text_end=stop_word_at, logits=logits, logprobs=logprobs)

    @staticmethod
    def _held_back(seq: Sequence) -> int:
        """Characters at the end of the text that may be the start of a stop word."""
        hold = 0
        for w in seq.params.stop_words:
            for n in range(min(len(w) - 1, len(seq.text)), hold, -1):
                if seq.text.endswith(w[:n]):
                    hold = n
                    break
        return hold

    def finish(self, seq: Sequence, reason: str, token_ids: list[int] | None = None, text_end: int | None = None,
               error: str | None = None, logits: torch.Tensor | None = None,
               logprobs: list[TokenLogprobs] | None = None) -> None:
        """The request's final emit, after its resources are released. Idempotent."""
        if seq.done:
            return
        end = len(seq.text) if text_end is None else text_end
        text = seq.text[seq.sent:end] if reason in ("stop", "length") else ""
        seq.sent = max(seq.sent, end)
        seq.done = True
        self.release(seq)
        try:
            seq.emit(_tagged(seq, GenerationOutput(list(token_ids or []), text, reason, error, logits, logprobs)))
        except Exception:
            log.exception("final emit of request %s raised", seq.request_id)

    def _emit(self, seq: Sequence, out: GenerationOutput) -> None:
        try:
            seq.emit(_tagged(seq, out))
        except Exception:
            log.exception("emit of request %s raised; ending it", seq.request_id)
            self.finish(seq, "error", error="emit failed")


def _tagged(seq: Sequence, out: GenerationOutput) -> GenerationOutput:
    """`out` with its sequence's index, and whether another sequence of its request still runs."""
    out.sequence_index = seq.index
    out.siblings_running = seq.group is not None and seq.group.running > 0
    return out
