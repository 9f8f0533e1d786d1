"""The `llm` model's responses as tensors (numpy arrays by output name), in tensorrtllm_backend's
names and shapes (one beam): `output_ids`, `text_output`, `finish_reason`, and where the request
asks, `cum_log_probs` [1], `output_log_probs` [1, tokens], `num_input_tokens` [1],
`num_output_tokens` [1] and `sequence_index` [1]; and ours, `top_log_probs` and `top_log_prob_ids`
[1, tokens, num_top_log_probs]."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from triton_vlm.contract.sampling import SamplingParams
from triton_vlm.llm.engine.streaming import GenerationOutput, TokenLogprobs


@dataclass
class _Sequence:
    """What one sequence of the request has generated so far (all of it for a non-streamed one)."""
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_output_tokens: int = 0
    cum_log_prob: float = 0.0


class ResponseBuilder:
    """One request's responses from its engine outputs (errors aside: the caller answers those).

    Streaming: one response per output, with that output's ids, text and log-probabilities;
    otherwise one response per sequence when it finishes, with all of them. `cum_log_probs` is the
    sum over every token the sequence generated so far. A sequence's last response (its
    `finish_reason` set) also carries `num_input_tokens` (the prompt's length with every media
    placeholder expanded, what the model read) and `num_output_tokens` (the tokens it generated).
    With `num_return_sequences` > 1 every response carries its `sequence_index`.

    `requested`: the outputs the client asked for (None or empty: all). A response holds only
    those: python_backend r24.10 drops the others from a sent response without the GIL, freeing
    their arrays in a race with every thread of the stub (fixed in r25.01, its PR 390), so a
    client asking for `text_output` alone must not make the llm build the rest.
    """

    def __init__(self, params: SamplingParams, stream: bool, num_input_tokens: int,
                 requested: frozenset[str] | None = None) -> None:
        self.params, self.stream, self.num_input_tokens = params, stream, num_input_tokens
        self.requested = requested or None
        self.sequences: dict[int, _Sequence] = {}

    def add(self, out: GenerationOutput) -> dict[str, np.ndarray] | None:
        """The response to send for this output; None while a non-streamed sequence goes on."""
        seq = self.sequences.setdefault(out.sequence_index, _Sequence())
        ids, text, logprobs = out.token_ids, out.text, out.logprobs or []
        seq.num_output_tokens += len(ids)
        seq.cum_log_prob += sum(p.logprob for p in logprobs)
        if not self.stream:
            seq.token_ids += ids
            seq.text.append(text)
            seq.logprobs += logprobs
            if not out.finished:
                return None
            ids, text, logprobs = seq.token_ids, "".join(seq.text), seq.logprobs
        tensors = {"output_ids": np.asarray(ids, dtype=np.int32),
                   "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
                   "finish_reason": np.array([(out.finish_reason or "").encode()], dtype=np.object_)}
        p = self.params
        if p.return_log_probs:
            tensors["cum_log_probs"] = np.array([seq.cum_log_prob], dtype=np.float32)
            tensors["output_log_probs"] = np.array([t.logprob for t in logprobs], dtype=np.float32).reshape(1, -1)
        if p.num_top_log_probs:
            shape = (1, len(logprobs), p.num_top_log_probs)
            tensors["top_log_probs"] = np.array([t.top_logprobs for t in logprobs], np.float32).reshape(shape)
            tensors["top_log_prob_ids"] = np.array([t.top_ids for t in logprobs], np.int32).reshape(shape)
        if p.num_return_sequences > 1:
            tensors["sequence_index"] = np.array([out.sequence_index], dtype=np.int32)
        if out.finished and p.return_num_input_tokens:
            tensors["num_input_tokens"] = np.array([self.num_input_tokens], dtype=np.int32)
        if out.finished and p.return_num_output_tokens:
            tensors["num_output_tokens"] = np.array([seq.num_output_tokens], dtype=np.int32)
        if self.requested is not None:
            tensors = {name: array for name, array in tensors.items() if name in self.requested}
        return tensors
