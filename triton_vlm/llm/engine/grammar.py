"""Guided (structured) decoding with xgrammar, as vLLM, SGLang and TensorRT-LLM do it.

`Grammars` (one per engine) holds xgrammar's `TokenizerInfo` of the checkpoint's tokenizer, made
at the first guided request (`tokenizer_info`), its `GrammarCompiler`, and the compiled grammars of
recent guides, keyed by (type, text). A request that asks for a guide gets a `GrammarMatcher` of its
own (`Grammars.matcher`). JSON is compact (xgrammar's `any_whitespace` off, vLLM's
`disable_any_whitespace`): free whitespace lets a weak model run on in blanks. Each step,
`bitmask` fills the next-token masks of the sampling rows that have one, which `sample_batch`
applies last, after penalties and the other masks, before temperature, top-k and top-p (on the
logits' device; a CUDA graph's logits are masked after its replay). After sampling, the engine
advances each matcher with its row's token. A matcher terminates only on one of the request's eos
ids (its stop tokens), which ends the request with "stop" as any eos does. Requests without a guide pay nothing: no matcher, no bitmask, and
xgrammar is not even imported until a first guided request.

A preempted sequence keeps its matcher: recompute rebuilds the KV of the tokens it already has,
which are the tokens its matcher has accepted, so the matcher's state is the one those tokens give.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from triton_vlm.contract.sampling import GUIDE, xgrammar_message
from triton_vlm.errors import InvalidInput
from triton_vlm.tokenizer import SentencePieceTokenizer

if TYPE_CHECKING:
    import xgrammar

GRAMMAR_CACHE = 64  # compiled grammars kept per engine (least recently used dropped first)
ANY_OBJECT = '{"type": "object"}'
_WHAT = {"json_schema": "invalid JSON schema", "regex": "invalid regex", "ebnf_grammar": "invalid EBNF grammar"}


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> "xgrammar.TokenizerInfo":
    """xgrammar's view of a checkpoint's tokenizer (`triton_vlm.tokenizer.load_tokenizer`), through
    its own `TokenizerInfo.from_huggingface`, which reads the vocabulary type and whether a space is
    prepended: a `tokenizers.Tokenizer` as the transformers fast tokenizer made of it (byte-level BPE
    for Qwen's and GLM's, byte-fallback for a Llama-like one, as its decoder says), a
    `SentencePieceTokenizer` as a SentencePiece tokenizer (its model's pieces and the added tokens;
    byte-fallback where the model has byte pieces, a space prepended). The mask covers the model's
    `vocab_size`: ids past the tokenizer's vocabulary are empty tokens, never allowed. The stop
    tokens are the checkpoint's eos ids (a request's matcher takes its own, `end_id` included)."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = tokenizer if isinstance(tokenizer, SentencePieceTokenizer) else PreTrainedTokenizerFast(
        tokenizer_object=tokenizer)
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))


class Grammars:
    """One engine's grammar compiler and its cache of compiled grammars (at most `cache_size`).
    Thread-safe: requests are checked on their callers' threads."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 cache_size: int = GRAMMAR_CACHE) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, frozenset(stop_token_ids)
        self.cache_size = cache_size
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str | None], xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def compiler(self) -> "xgrammar.GrammarCompiler":
        """Made (with the tokenizer's info) at the first guided request."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                # the cache is ours, keyed by the guide as sent
                self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1),
                                                     cache_enabled=False)
            return self._compiler

    def compile(self, guide_type: str, guide: str | None) -> "xgrammar.CompiledGrammar":
        """The grammar of a checked guide (`SamplingParams`' `guide_type`, `guide`); InvalidInput
        naming `guided_decoding_guide` where xgrammar cannot compile it."""
        key = (guide_type, guide)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiler = self.compiler
        try:
            if guide_type in ("json", "json_schema"):  # "json": any object, as vLLM's json_object
                grammar = compiler.compile_json_schema(guide or ANY_OBJECT, any_whitespace=False)
            elif guide_type == "regex":
                grammar = compiler.compile_regex(guide)
            else:
                grammar = compiler.compile_grammar(guide)
        except Exception as error:  # xgrammar's errors (RuntimeError, ValueError, its own) on a guide
            raise InvalidInput(f"{GUIDE}: {_WHAT[guide_type]}: {xgrammar_message(error)}") from None
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    @staticmethod
    def matcher(grammar: "xgrammar.CompiledGrammar", eos_token_ids: Iterable[int]) -> "xgrammar.GrammarMatcher":
        """A request's matcher, whose stop tokens are its own eos ids."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(grammar, override_stop_tokens=sorted(eos_token_ids))


def bitmask(matchers: Sequence["xgrammar.GrammarMatcher | None"], vocab_size: int
            ) -> tuple[torch.Tensor, list[int]] | None:
    """The next-token bitmask (int32 [rows, ceil(vocab / 32)], on the host) of the rows whose
    matcher is not None, and those rows; None when no row has one."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for i in rows:
        matchers[i].fill_next_token_bitmask(mask, i)
    return mask, rows


def apply_bitmask(scores: torch.Tensor, mask: tuple[torch.Tensor, list[int]]) -> None:
    """-inf in place (float32 scores [rows, vocab] on any device) for every token a row's grammar
    does not allow; the bitmask goes to the scores' device in one copy."""
    import xgrammar as xgr

    bits, rows = mask
    if scores.device.type == "cuda":
        bits = bits.pin_memory().to(scores.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(scores, bits, vocab_size=scores.shape[1], indices=rows)
