"""Sampling controls of a request and the batched token sampler (as Hugging Face `generate` samples).

`sample_batch` draws one token per row of a [rows, vocab] logits batch on the logits' device, in
transformers' order: repetition penalty, then (sampled rows) temperature, top-k, top-p, softmax and
one `torch.multinomial` draw. Each request owns a `torch.Generator` seeded from its `seed`, and a row
draws its noise from its own generator only, so the same seed gives the same tokens whatever else
is in the batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

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


NO_TOKEN = -1  # `sample_batch`'s id for a row without a distribution (NaN scores or probabilities)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's generator, on the device its logits will be on; seed None: a random seed."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def _on(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on `device`; through pinned memory to CUDA, so the copy does not wait
    for the stream (a copy from pageable memory synchronizes it)."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _penalized(scores: torch.Tensor, params: Sequence[SamplingParams],
               context_ids: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """transformers' `RepetitionPenaltyLogitsProcessor` on the rows whose penalty is not 1: each row's
    context ids (padded to the longest with id `vocab`, which lands in an extra column dropped after,
    as transformers does with ids past the vocabulary) are gathered, penalized and scattered back."""
    rows = [i for i, p in enumerate(params)
            if p.repetition_penalty != 1.0 and context_ids[i] is not None and context_ids[i].numel()]
    if not rows:
        return scores
    vocab, device = scores.shape[1], scores.device
    ids = torch.nn.utils.rnn.pad_sequence([context_ids[i].reshape(-1).long().cpu() for i in rows],
                                          batch_first=True, padding_value=vocab).clamp_(max=vocab)
    ids = _on(ids, torch.long, device)
    index = _on(rows, torch.long, device)
    penalty = _on([params[i].repetition_penalty for i in rows], torch.float32, device)[:, None]
    padded = F.pad(scores[index], (0, 1))
    score = padded.gather(1, ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return scores.index_copy(0, index, padded.scatter(1, ids, score)[:, :vocab])


def _warped(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """transformers' `TemperatureLogitsWarper`, `TopKLogitsWarper` and `TopPLogitsWarper` (in that
    order) with per-row values; a row whose value is "off" (temperature 1, top_k 0, top_p 1) is left
    as transformers leaves it (dividing by 1 changes nothing).

    Top-p sorts stably, so tied scores at the cut go by token id: transformers' unstable sort leaves
    their order to the sort kernel, which differs between batch shapes. The cumulative sum runs in
    float64, rounded to float32: on CPU that is exactly its float32 `cumsum` (which accumulates in
    double); CUDA's scan kernels add in an order that depends on the batch shape, and the rounding
    hides that order unless a sum lies within float64 error of a float32 rounding point."""
    vocab, device = scores.shape[1], scores.device
    scores = scores / _on([p.temperature for p in params], torch.float32, device)[:, None]
    ks = [min(p.top_k, vocab) for p in params]
    if any(ks):
        k = _on(ks, torch.long, device)[:, None]
        kth = torch.topk(scores, max(ks)).values.gather(1, (k - 1).clamp(min=0))
        scores = scores.masked_fill(scores < kth.masked_fill(k == 0, -math.inf), -math.inf)
    if any(p.top_p < 1.0 for p in params):
        cut = _on([1 - p.top_p if p.top_p < 1.0 else -math.inf for p in params], torch.float32, device)[:, None]
        sorted_scores, order = torch.sort(scores, stable=True)
        cumulative = sorted_scores.softmax(dim=-1).double().cumsum(dim=-1).float()
        remove = cumulative <= cut
        remove[:, -1] = False
        scores = scores.masked_fill(remove.scatter(1, order, remove), -math.inf)
    return scores


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None],
                 context_ids: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """One token id per row of `logits` [rows, vocab] (any float dtype, any device), as long [rows] on
    that device. Row i samples with `params[i]` and `generators[i]` (None: the device's default);
    `context_ids[i]` (prompt and generated ids, or None) feeds its repetition penalty.

    Greedy rows (temperature 0) take the argmax of the penalized scores. The others draw as
    `torch.multinomial(probs, 1)` does for one sample (ATen's fast path: argmax of probs / q with
    q ~ Exp(1) from `empty_like(probs).exponential_(1, generator)`), each row's q from its own
    generator: a row's token and its generator's state afterwards are those of
    `torch.multinomial(probs_row[None], 1, generator=g)`. Where torch.multinomial would refuse
    (probabilities with NaN: NaN, +inf or all -inf scores), and for a greedy row with a NaN score,
    the id is `NO_TOKEN`."""
    if logits.ndim != 2 or not len(params) == len(generators) == len(context_ids) == logits.shape[0]:
        raise ValueError(f"logits {list(logits.shape)} with {len(params)} params, {len(generators)} generators, "
                         f"{len(context_ids)} contexts")
    scores = _penalized(logits.float(), params, context_ids)
    tokens = scores.argmax(dim=-1)
    invalid = scores.isnan().any(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = _on(rows, torch.long, scores.device)
        probs = _warped(scores[index], [params[i] for i in rows]).softmax(dim=-1)
        q = torch.empty_like(probs)
        for j, i in enumerate(rows):
            q[j].exponential_(generator=generators[i])
        tokens[index] = (probs / q).argmax(dim=-1)
        invalid[index] = probs.isnan().any(dim=-1)
    return tokens.masked_fill(invalid, NO_TOKEN)
