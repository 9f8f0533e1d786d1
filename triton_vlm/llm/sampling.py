"""Sampling controls of a request and the token sampler (as Hugging Face `generate` samples).

Order as in transformers: temperature, then top-k, then top-p filtering, then softmax and
`torch.multinomial`. Each request owns a `torch.Generator` seeded from its `seed`, so the same seed
gives the same tokens whatever else the engine runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from triton_vlm.errors import InvalidInput

UINT64_MAX = 2 ** 64 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0        # (0, 1]
    top_k: int = 0            # 0: off
    seed: int | None = None   # uint64; None: a random seed per request
    stop_words: list[str] = field(default_factory=list)
    repetition_penalty: float = 1.0  # > 0; 1: off (as Hugging Face: over prompt and generated ids)

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidInput(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidInput(f"temperature: must be >= 0, got {self.temperature:g}"
                               if isinstance(self.temperature, (int, float)) else
                               f"temperature: must be a number >= 0, got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not (0.0 < self.top_p <= 1.0):
            raise InvalidInput(f"top_p: must be in (0, 1], got {self.top_p}")
        self.top_p = float(self.top_p)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidInput(f"top_k: must be >= 0, got {self.top_k}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= UINT64_MAX):
            raise InvalidInput(f"seed: must be an integer in [0, {UINT64_MAX}], got {self.seed}")
        if isinstance(self.stop_words, str):
            raise InvalidInput("stop_words: must be a list of strings, got one string")
        words = list(self.stop_words or [])
        for i, w in enumerate(words):
            if not isinstance(w, str) or not w:
                raise InvalidInput(f"stop_words[{i}]: must be a non-empty string, got {w!r}")
        self.stop_words = words
        if isinstance(self.repetition_penalty, bool) or not isinstance(self.repetition_penalty, (int, float)) \
                or not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidInput(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        self.repetition_penalty = float(self.repetition_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_inputs(cls, inputs: Mapping[str, Any]) -> "SamplingParams":
        """From Triton-style inputs (`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
        `repetition_penalty`, `stop_words`), each a scalar, a list or a numpy array of shape [1] (stop_words [-1] BYTES),
        or absent / None for the default. As in tensorrtllm_backend, 0 for `temperature`, `top_p` or
        `top_k` also means "not set" (greedy, no nucleus cut, no top-k cut); stop words are UTF-8, an
        undecodable byte becoming U+FFFD."""

        def scalar(name: str, kind):
            value = inputs.get(name)
            if value is None:
                return None
            if hasattr(value, "reshape"):  # numpy / torch
                value = value.reshape(-1).tolist()
            if isinstance(value, (list, tuple)):
                if len(value) != 1:
                    raise InvalidInput(f"{name}: expected one value, got {len(value)}")
                value = value[0]
            if kind is int:
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                if not _is_int(value):
                    raise InvalidInput(f"{name}: must be an integer, got {value!r}")
                return int(value)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidInput(f"{name}: must be a number, got {value!r}")
            return float(value)

        max_tokens = scalar("max_tokens", int)
        if max_tokens is None:
            raise InvalidInput("max_tokens: required input is missing")
        kwargs: dict[str, Any] = {"max_tokens": max_tokens}
        for name, kind, unset in (("temperature", float, (None, 0)), ("top_p", float, (None, 0)),
                                  ("top_k", int, (None, 0)), ("seed", int, (None,)),
                                  ("repetition_penalty", float, (None,))):
            value = scalar(name, kind)
            if value not in unset:
                kwargs[name] = value
        words = inputs.get("stop_words")
        if words is not None:
            if hasattr(words, "reshape"):
                words = words.reshape(-1).tolist()
            kwargs["stop_words"] = [bytes(w).decode("utf-8", "replace") if isinstance(w, (bytes, bytearray)) else w
                                    for w in words]
        return cls(**kwargs)


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           context_ids: torch.Tensor | None = None) -> int:
    """One token id from logits [vocab] (float32); `context_ids` (prompt and generated ids) feed the
    repetition penalty, applied first as transformers' `RepetitionPenaltyLogitsProcessor` does."""
    scores = logits.reshape(1, -1).float()
    if params.repetition_penalty != 1.0 and context_ids is not None and context_ids.numel():
        ids = context_ids.reshape(1, -1).long()
        score = torch.gather(scores, 1, ids)
        score = torch.where(score < 0, score * params.repetition_penalty, score / params.repetition_penalty)
        scores = scores.scatter(1, ids, score)
    if params.greedy:
        return int(scores.argmax(dim=-1))
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - params.top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
        scores = scores.masked_fill(remove, -float("inf"))
    probs = scores.softmax(dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator)[0, 0])
