"""The batched token sampler (as Hugging Face `generate` samples); the controls are `SamplingParams`.

`sample_batch` draws one token per row of a [rows, vocab] logits batch on the logits' device: a
row's `embedding_bias` first (as tensorrtllm_backend adds it), then in transformers' order: repetition penalty, then vLLM's frequency and presence penalties, the masks
(eos before `min_tokens`, bad words), the grammar's mask of guided rows last (as vLLM applies it,
`triton_vlm.llm.engine.grammar`), then (sampled rows) temperature, top-k, top-p, softmax and
one `torch.multinomial` draw. Each request owns a `torch.Generator` seeded from its `seed`, and a row
draws its noise from its own generator only, so the same seed gives the same tokens whatever else
is in the batch.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from triton_vlm.contract.sampling import SamplingParams
from triton_vlm.llm.engine.grammar import apply_bitmask

__all__ = ["NO_ALLOWED_TOKEN", "NO_TOKEN", "SamplingParams", "make_generator", "sample_batch", "token_logprobs"]

NO_TOKEN = -1  # `sample_batch`'s id for a row without a distribution (NaN scores or probabilities)
NO_ALLOWED_TOKEN = -2  # its id for a guided row whose grammar and other masks (min_tokens, bad words) leave none


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


def _biased(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The rows that carry an `embedding_bias` plus it (a new tensor: the raw logits stay as they are).
    The engine's requests carry it as a tensor on the logits' device already (`InputProcessor`)."""
    rows = [i for i, p in enumerate(params) if p.embedding_bias is not None]
    if not rows:
        return scores
    bias = torch.stack([torch.as_tensor(params[i].embedding_bias) for i in rows]).to(scores.device)
    return scores.index_add(0, _on(rows, torch.long, scores.device), bias)


def _output_penalized(scores: torch.Tensor, params: Sequence[SamplingParams],
                      context_ids: Sequence[torch.Tensor | None], num_generated: Sequence[int]) -> torch.Tensor:
    """vLLM's (and OpenAI's) frequency and presence penalties on the rows that set one: a token's score
    goes down by frequency_penalty times its count among the row's generated ids (the last
    `num_generated` of its context ids), and by presence_penalty if that count is not 0."""
    rows = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and num_generated[i]
            and context_ids[i] is not None]
    if not rows:
        return scores
    vocab, device = scores.shape[1], scores.device
    ids = torch.nn.utils.rnn.pad_sequence([context_ids[i].reshape(-1)[-num_generated[i]:].long().cpu() for i in rows],
                                          batch_first=True, padding_value=vocab).clamp_(max=vocab)
    ids = _on(ids, torch.long, device)
    counts = torch.zeros(len(rows), vocab + 1, device=device).scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    counts = counts[:, :vocab]
    index = _on(rows, torch.long, device)
    frequency = _on([params[i].frequency_penalty for i in rows], torch.float32, device)[:, None]
    presence = _on([params[i].presence_penalty for i in rows], torch.float32, device)[:, None]
    return scores.index_copy(0, index, scores[index] - frequency * counts - presence * (counts > 0))


def _masked(scores: torch.Tensor, params: Sequence[SamplingParams], context_ids: Sequence[torch.Tensor | None],
            num_generated: Sequence[int]) -> torch.Tensor:
    """-inf for the tokens a row may not take now: its eos ids while fewer than `min_tokens` are
    generated (transformers' `MinNewTokensLengthLogitsProcessor`), and the last token of each bad word
    whose other tokens end the row's context ids (`NoBadWordsLogitsProcessor`: a one-token word always)."""
    vocab = scores.shape[1]
    rows, tokens = [], []
    for i, p in enumerate(params):
        banned = list(p.eos_token_ids) if num_generated[i] < p.min_tokens else []
        if p.bad_word_ids:
            longest = max(len(w) for w in p.bad_word_ids) - 1
            tail = context_ids[i].reshape(-1)[-longest:].tolist() if longest and context_ids[i] is not None else []
            banned += [w[-1] for w in p.bad_word_ids
                       if len(w) == 1 or (len(w) - 1 <= len(tail) and tuple(tail[len(tail) - len(w) + 1:]) == w[:-1])]
        banned = [t for t in banned if t < vocab]
        rows += [i] * len(banned)
        tokens += banned
    if not rows:
        return scores
    index = (_on(rows, torch.long, scores.device), _on(tokens, torch.long, scores.device))
    return scores.index_put(index, torch.tensor(-math.inf, device=scores.device))


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
                 context_ids: Sequence[torch.Tensor | None],
                 num_generated: Sequence[int] | None = None,
                 grammar_mask: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
    """One token id per row of `logits` [rows, vocab] (any float dtype, any device), as long [rows] on
    that device. Row i samples with `params[i]` and `generators[i]` (None: the device's default);
    `context_ids[i]` (prompt and generated ids, or None) feeds its penalties and bad words, and its
    last `num_generated[i]` ids (None: 0 each) are the generated ones, which the frequency and
    presence penalties and `min_tokens` count. `grammar_mask` (`grammar.bitmask`: a host bitmask
    and its rows), where given, leaves those rows only the tokens their grammars allow; a row left
    with none gets `NO_ALLOWED_TOKEN`.

    Greedy rows (temperature 0) take the argmax of the penalized scores. The others draw as
    `torch.multinomial(probs, 1)` does for one sample (ATen's fast path: argmax of probs / q with
    q ~ Exp(1) from `empty_like(probs).exponential_(1, generator)`), each row's q from its own
    generator: a row's token and its generator's state afterwards are those of
    `torch.multinomial(probs_row[None], 1, generator=g)`. Where torch.multinomial would refuse
    (probabilities with NaN: NaN, +inf or all -inf scores), and for a greedy row with a NaN score,
    the id is `NO_TOKEN`."""
    num_generated = [0] * len(params) if num_generated is None else num_generated
    if logits.ndim != 2 or not (len(params) == len(generators) == len(context_ids) == len(num_generated)
                                == logits.shape[0]):
        raise ValueError(f"logits {list(logits.shape)} with {len(params)} params, {len(generators)} generators, "
                         f"{len(context_ids)} contexts, {len(num_generated)} generated counts")
    scores = _penalized(_biased(logits.float(), params), params, context_ids)
    scores = _masked(_output_penalized(scores, params, context_ids, num_generated), params, context_ids, num_generated)
    empty = None
    if grammar_mask is not None:  # in place, on a copy: the raw logits feed `token_logprobs` and outputs
        scores = scores.clone(memory_format=torch.contiguous_format)
        apply_bitmask(scores, grammar_mask)
        guided = _on(grammar_mask[1], torch.long, scores.device)
        empty = torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
        empty[guided] = scores[guided].isneginf().all(dim=-1)
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
    tokens = tokens.masked_fill(invalid, NO_TOKEN)
    return tokens if empty is None else tokens.masked_fill(empty, NO_ALLOWED_TOKEN)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: Sequence[int],
                   top: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row i of `rows`: the log-probability of `tokens[i]` and the `top` most likely tokens
    with theirs, under the model's own distribution: log_softmax of the raw logits, before any
    penalty, mask, temperature or cut (vLLM's default `raw_logprobs`). float32 [len(rows)], then
    float32 and long [len(rows), top] (most likely first), on the logits'
    device; a `NO_TOKEN` row gets token 0's."""
    index = _on(rows, torch.long, logits.device)
    picked = tokens[index].clamp(min=0)[:, None]
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)
    best = torch.topk(logprobs, top, dim=-1, sorted=True)  # (top 0: empty [rows, 0])
    return logprobs.gather(1, picked)[:, 0], best.values, best.indices
