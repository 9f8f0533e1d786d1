"""What a request's engine outputs carry (`GenerationOutput`: new ids, their text, a finish reason),
and the incremental detokenizer that streams text without splitting a UTF-8 character."""
from __future__ import annotations

from dataclasses import dataclass

import torch

FINISH_REASONS = ("stop", "length", "cancelled", "rejected", "error")


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and, where asked (`num_top_log_probs`), the most likely
    tokens at that step with theirs, most likely first."""
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # None or one of FINISH_REASONS
    error: str | None = None          # set with finish_reason "rejected" or "error"
    logits: torch.Tensor | None = None  # the sampled step's logits, with Engine(return_logits=True)
    logprobs: list[TokenLogprobs] | None = None  # one per token id, where the request asks
    sequence_index: int = 0  # which of the request's `num_return_sequences` this is
    # Another sequence of the same request is still going: this output's finish is not the request's.
    siblings_running: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def request_finished(self) -> bool:
        """The request's last output: this sequence ended and no other of its sequences runs."""
        return self.finished and not self.siblings_running


class IncrementalDetokenizer:
    """Streams text for generated ids; holds text back while it ends in U+FFFD (a partial UTF-8
    character), decoding only a small window of ids per token."""

    def __init__(self, tokenizer, prompt_tail: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_tail)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is held back (a trailing partial character decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""

