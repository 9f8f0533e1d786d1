"""A request's generation controls (`SamplingParams`) and their parser from Triton inputs: the one
place they are validated. No torch here: the `ensemble` checks a request with it before any step
runs, and the `llm` parses the same inputs again.

The inputs are the contract's and tensorrtllm_backend's ensemble inputs, with their names. Every
value is honoured or refused with `InvalidInput` naming the input and the value.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from triton_vlm.errors import InvalidInput

UINT64_MAX = 2 ** 64 - 1
# A guide's length at most: compiling one holds the llm's submit thread, so a client's guide is
# bounded (a forced tool call's grammar of a few tools is a few KiB).
MAX_GUIDE_CHARS = 1 << 18
# The most alternatives per token `num_top_log_probs` asks for (OpenAI's `top_logprobs` limit), and
# the most sequences one request generates (`num_return_sequences`; each holds a place in the batch).
MAX_TOP_LOG_PROBS = 20
MAX_RETURN_SEQUENCES = 16


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _words(name: str, words: Any) -> list[str]:
    if isinstance(words, str):
        raise InvalidInput(f"{name}: must be a list of strings, got one string")
    words = list(words or [])
    for i, w in enumerate(words):
        if not isinstance(w, str) or not w:
            raise InvalidInput(f"{name}[{i}]: must be a non-empty string, got {w!r}")
    return words


def _text(inputs: Mapping[str, Any], name: str) -> str | None:
    """A BYTES [1] input as text (UTF-8, refused if it is not), or None where absent."""
    value = inputs.get(name)
    if value is None:
        return None
    if hasattr(value, "reshape"):
        value = value.reshape(-1).tolist()
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise InvalidInput(f"{name}: expected one value, got {len(value)}")
        value = value[0]
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidInput(f"{name}: not UTF-8 ({error.reason} at byte {error.start})") from None
    if not isinstance(value, str):
        raise InvalidInput(f"{name}: must be text, got {value!r}")
    return value


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def xgrammar_message(error: Exception) -> str:
    """xgrammar's message without its time, source line and check prefixes."""
    text = (str(error).strip() or type(error).__name__).splitlines()[0]
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return re.sub(r"^Check failed: .*? is false: ", "", text)[:500]


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0        # (0, 1]
    top_k: int = 0            # 0: off
    seed: int | None = None   # uint64; None: a random seed per request
    stop_words: list[str] = field(default_factory=list)
    repetition_penalty: float = 1.0  # > 0; 1: off (as Hugging Face: over prompt and generated ids)
    # The eos ids (`eos_token_ids`) are masked until this many tokens are generated (transformers'
    # MinNewTokensLengthLogitsProcessor, tensorrtllm_backend's `min_tokens`); stop words still apply.
    min_tokens: int = 0
    # OpenAI / vLLM: a token's score goes down by presence_penalty if it is among the generated ids,
    # and by frequency_penalty times its count there. In [-2, 2]; 0: off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Banned token sequences, as tensorrtllm_backend's `bad_words`: each word tokenized alone (see
    # `for_model`); its last token is masked wherever the others end the ids so far.
    bad_words: list[str] = field(default_factory=list)
    end_id: int | None = None  # the one eos id to stop on (replaces the checkpoint's)
    pad_id: int | None = None  # accepted, unused: outputs are never padded
    return_log_probs: bool = False       # the `cum_log_probs` / `output_log_probs` outputs
    # The `top_log_probs` / `top_log_prob_ids` outputs: this many most likely tokens at each step,
    # under the same distribution as `output_log_probs`; 0: none.
    num_top_log_probs: int = 0
    # tensorrtllm_backend's `num_return_sequences`: this many sequences from one prefill of the
    # prompt, each response tagged with its `sequence_index` (seeded: sequence i draws with seed + i).
    num_return_sequences: int = 1
    return_num_input_tokens: bool = True   # the `num_input_tokens` output (on by default, unlike tensorrtllm_backend)
    return_num_output_tokens: bool = True  # the `num_output_tokens` output (likewise)
    # Guided (structured) decoding, tensorrtllm_backend's `guided_decoding_guide_type` and
    # `guided_decoding_guide`: None (off), or a `GUIDE_TYPES` key; the guide is the JSON schema, the
    # regular expression or the EBNF grammar (GBNF, as xgrammar reads it), None for "json" (any JSON
    # object). Compiled by the engine, which refuses one it cannot compile.
    guide_type: str | None = None
    guide: str | None = None
    # tensorrtllm_backend's `embedding_bias`: float32 [vocab], added to the logits before any other
    # control (OpenAI's `logit_bias` as a dense row); None: none. The llm engine keeps it as a tensor on
    # the logits' device (checked here first).
    embedding_bias: Any = None
    # Set by `for_model` when the engine takes the request.
    eos_token_ids: frozenset[int] = frozenset()
    bad_word_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidInput(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not _is_number(self.temperature) or self.temperature < 0:
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
        self.stop_words = _words("stop_words", self.stop_words)
        self.bad_words = _words("bad_words", self.bad_words)
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidInput(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        self.repetition_penalty = float(self.repetition_penalty)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidInput(f"min_tokens: must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise InvalidInput(f"{name}: must be in [-2, 2], got {value}")
            setattr(self, name, float(value))
        for name in ("end_id", "pad_id"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise InvalidInput(f"{name}: must be a token id >= 0, got {value}")
        for name, low, high in (("num_top_log_probs", 0, MAX_TOP_LOG_PROBS),
                                ("num_return_sequences", 1, MAX_RETURN_SEQUENCES)):
            value = getattr(self, name)
            if not _is_int(value) or not low <= value <= high:
                raise InvalidInput(f"{name}: must be in [{low}, {high}] (max_{name.removeprefix('num_')}={high}), "
                                   f"got {value}")
        for name in ("return_log_probs", "return_num_input_tokens", "return_num_output_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInput(f"{name}: must be true or false, got {getattr(self, name)!r}")
        self._check_guide()
        if self.embedding_bias is not None:
            bias = np.asarray(self.embedding_bias, dtype=np.float32).reshape(-1)
            if not np.isfinite(bias).all():
                raise InvalidInput("embedding_bias: must be finite numbers")
            self.embedding_bias = bias if bias.size else None

    def _check_guide(self) -> None:
        """A known guide type, with a guide where it needs one and none where it takes none."""
        kind, guide = self.guide_type, self.guide
        if kind is None:
            if guide is not None:
                raise InvalidInput(f"{GUIDE}: given without {GUIDE_TYPE}")
            return
        if kind not in GUIDE_TYPES:
            raise InvalidInput(f"{GUIDE_TYPE}: must be one of {', '.join(GUIDE_TYPES)}, got {kind!r}")
        if not GUIDE_TYPES[kind]:
            if guide is not None:
                raise InvalidInput(f"{GUIDE}: not taken with {GUIDE_TYPE} {kind} (any JSON object)")
        elif not isinstance(guide, str) or not guide.strip():
            raise InvalidInput(f"{GUIDE}: required with {GUIDE_TYPE} {kind}"
                               + ("" if guide is None else ", got an empty one"))
        elif len(guide) > MAX_GUIDE_CHARS:  # the llm compiles it on its submit thread
            raise InvalidInput(f"{GUIDE}: {len(guide)} characters exceed max_guide_chars={MAX_GUIDE_CHARS}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reads_context(self) -> bool:
        """Whether sampling looks at the request's ids so far (penalties, bad words)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty or self.frequency_penalty
                                                       or self.bad_word_ids)

    def for_model(self, vocab_size: int, eos_token_ids: Iterable[int],
                  tokenize: Callable[[str], list[int]]) -> SamplingParams:
        """These controls for one model, as its engine applies them: `end_id` and `pad_id` checked
        against its vocabulary; `eos_token_ids` (`end_id`, else the checkpoint's eos ids); bad words
        tokenized each alone without special tokens, as tensorrtllm_backend's preprocessing does (a
        word of no tokens is dropped)."""
        for name in ("end_id", "pad_id"):
            value = getattr(self, name)
            if value is not None and value >= vocab_size:
                raise InvalidInput(f"{name}: must be a token id in [0, {vocab_size}), got {value}")
        if self.embedding_bias is not None and self.embedding_bias.size != vocab_size:
            raise InvalidInput(f"embedding_bias: {self.embedding_bias.size} values; one per token of the model's "
                               f"vocabulary, {vocab_size}")
        words = (tuple(tokenize(w)) for w in self.bad_words)
        return dataclasses.replace(
            self, eos_token_ids=frozenset([self.end_id] if self.end_id is not None else eos_token_ids),
            bad_word_ids=tuple(ids for ids in words if ids))

    @classmethod
    def from_inputs(cls, inputs: Mapping[str, Any]) -> SamplingParams:
        """From Triton-style inputs (see `INPUTS`, `ONE_VALUE_INPUTS`, `ALIASES`, `GUIDE_TYPE` and
        `GUIDE`), each a scalar, a list or a numpy array of shape [1] (the word lists [-1] BYTES),
        or absent / None for the default. Other inputs are ignored. As in tensorrtllm_backend, 0
        for `temperature`, `top_p` or `top_k` also means "not set" (greedy, no nucleus cut, no
        top-k cut); words are UTF-8, an undecodable byte becoming U+FFFD; a guide type or guide
        that is not UTF-8 is refused."""

        def scalar(name: str, kind: type) -> Any:
            value = inputs.get(name)
            if value is None:
                return None
            if hasattr(value, "reshape"):  # numpy / torch
                value = value.reshape(-1).tolist()
            if isinstance(value, (list, tuple)):
                if len(value) != 1:
                    raise InvalidInput(f"{name}: expected one value, got {len(value)}")
                value = value[0]
            if kind is bool:
                if not isinstance(value, bool):
                    raise InvalidInput(f"{name}: must be true or false, got {value!r}")
                return value
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
        for name, (kind, unset) in INPUTS.items():
            value = scalar(name, kind)
            if value not in unset:
                kwargs[name] = value
        renamed: dict[str, str] = {}
        for alias, name in ALIASES.items():
            value = scalar(alias, INPUTS[name][0])
            if value in INPUTS[name][1]:
                continue
            if name in kwargs and kwargs[name] != value:
                raise InvalidInput(f"{alias}: the old name of {name}, both set, to {value} and {kwargs[name]}")
            kwargs[name], renamed[name] = value, alias
        for name, (kind, only, why) in ONE_VALUE_INPUTS.items():
            value = scalar(name, kind)
            if value is not None and value != only:
                raise InvalidInput(f"{name}: {_show(value)} is not supported ({why}); "
                                   f"send {_show(only)} or leave it out")
        for name, field_name in ((GUIDE_TYPE, "guide_type"), (GUIDE, "guide")):
            value = _text(inputs, name)
            if value is not None:
                kwargs[field_name] = value
        if inputs.get("embedding_bias") is not None:
            kwargs["embedding_bias"] = inputs["embedding_bias"]
        for name in ("stop_words", "bad_words"):
            words = inputs.get(name)
            if words is not None:
                if hasattr(words, "reshape"):
                    words = words.reshape(-1).tolist()
                kwargs[name] = [bytes(w).decode("utf-8", "replace") if isinstance(w, (bytes, bytearray)) else w
                                for w in words]
        try:
            return cls(**kwargs)
        except InvalidInput as error:  # a value sent under an old name is refused under that name
            name, _, rest = str(error).partition(":")
            if name in renamed:
                raise InvalidInput(f"{renamed[name]}:{rest}") from None
            raise


# Scalar inputs read into the field of the same name: (type, the values that mean "not set").
INPUTS: dict[str, tuple[type, tuple]] = {
    "temperature": (float, (None, 0)), "top_p": (float, (None, 0)), "top_k": (int, (None, 0)),
    "seed": (int, (None,)), "repetition_penalty": (float, (None,)), "min_tokens": (int, (None,)),
    "presence_penalty": (float, (None,)), "frequency_penalty": (float, (None,)), "end_id": (int, (None,)),
    "pad_id": (int, (None,)), "return_log_probs": (bool, (None,)), "return_num_input_tokens": (bool, (None,)),
    "return_num_output_tokens": (bool, (None,)), "num_top_log_probs": (int, (None,)),
    "num_return_sequences": (int, (None,)),
}
# tensorrtllm_backend's guided decoding inputs (BYTES [1] each), and its guide types, each with
# whether it takes a guide: "json" any JSON object, "json_schema" a JSON schema (as text),
# "regex" a regular expression, "ebnf_grammar" an EBNF grammar (GBNF, its start rule `root`).
GUIDE_TYPE, GUIDE = "guided_decoding_guide_type", "guided_decoding_guide"
GUIDE_TYPES = {"json": False, "json_schema": True, "regex": True, "ebnf_grammar": True}
# Older tensorrtllm_backend names of two inputs (genai-perf 0.0.16 sends `min_length`).
ALIASES = {"random_seed": "seed", "min_length": "min_tokens"}
# tensorrtllm_backend inputs served with one value only (absent: that value): (type, value, why).
ONE_VALUE_INPUTS: dict[str, tuple[type, Any, str]] = {
    "exclude_input_in_output": (bool, True, "outputs never include the prompt"),
    "beam_width": (int, 1, "no beam search"),
    "length_penalty": (float, 1.0, "it applies to beam search, which is not supported"),
    "return_context_logits": (bool, False, "logits are not returned"),
    "return_generation_logits": (bool, False, "logits are not returned"),
    "return_perf_metrics": (bool, False, "no per-request perf metrics"),
}
