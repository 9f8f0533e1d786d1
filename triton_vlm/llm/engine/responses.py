"""The `llm` model's responses as tensors (numpy arrays by output name), in tensorrtllm_backend's
names and shapes (one beam): `output_ids`, `text_output`, `finish_reason`, and where the request
asks, `cum_log_probs` [1], `output_log_probs` [1, tokens], `num_input_tokens` [1] and
`num_output_tokens` [1]."""
from __future__ import annotations

import numpy as np

from triton_vlm.contract.sampling import SamplingParams
from triton_vlm.llm.engine.streaming import GenerationOutput


class ResponseBuilder:
    """One request's responses from its engine outputs (errors aside: the caller answers those).

    Streaming: one response per output, with that output's ids, text and log-probabilities;
    otherwise one response when the request finishes, with all of them. `cum_log_probs` is the sum
    over every token generated so far. The final response (its `finish_reason` set) also carries
    `num_input_tokens` (the prompt's length with every media placeholder expanded, what the model
    read) and `num_output_tokens` (the tokens generated).

    `requested`: the outputs the client asked for (None or empty: all). A response holds only
    those: python_backend r24.10 drops the others from a sent response without the GIL, freeing
    their arrays in a race with every thread of the stub (fixed in r25.01, its PR 390), so a
    client asking for `text_output` alone must not make the llm build the rest.
    """

    def __init__(self, params: SamplingParams, stream: bool, num_input_tokens: int,
                 requested: frozenset[str] | None = None) -> None:
        self.params, self.stream, self.num_input_tokens = params, stream, num_input_tokens
        self.requested = requested or None
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[float] = []
        self.num_output_tokens = 0
        self.cum_log_prob = 0.0

    def add(self, out: GenerationOutput) -> dict[str, np.ndarray] | None:
        """The response to send for this output; None while a non-streamed request goes on."""
        ids, text, logprobs = out.token_ids, out.text, out.logprobs or []
        self.num_output_tokens += len(ids)
        self.cum_log_prob += sum(logprobs)
        if not self.stream:
            self.token_ids += ids
            self.text.append(text)
            self.logprobs += logprobs
            if not out.finished:
                return None
            ids, text, logprobs = self.token_ids, "".join(self.text), self.logprobs
        tensors = {"output_ids": np.asarray(ids, dtype=np.int32),
                   "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
                   "finish_reason": np.array([(out.finish_reason or "").encode()], dtype=np.object_)}
        if self.params.return_log_probs:
            tensors["cum_log_probs"] = np.array([self.cum_log_prob], dtype=np.float32)
            tensors["output_log_probs"] = np.asarray(logprobs, dtype=np.float32).reshape(1, -1)
        if out.finished and self.params.return_num_input_tokens:
            tensors["num_input_tokens"] = np.array([self.num_input_tokens], dtype=np.int32)
        if out.finished and self.params.return_num_output_tokens:
            tensors["num_output_tokens"] = np.array([self.num_output_tokens], dtype=np.int32)
        if self.requested is not None:
            tensors = {name: array for name, array in tensors.items() if name in self.requested}
        return tensors
