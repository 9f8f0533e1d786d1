"""The `llm` step's engine: one scheduler thread, per-sequence forward passes, streaming emits.

Each scheduler step admits waiting requests (prefill, which yields their first token) and advances
every other running sequence by one token, round-robin. Sequences are run one by one (no padded
batch), so each request gets exactly the tokens it gets alone. Every request gets exactly one final
emit (`finish_reason` set): on stop, length, cancel, shutdown, or an error inside the loop
(`finish_reason="error"` with `error` set). The thread logs exceptions and never dies of them.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from triton_vlm.errors import InvalidInput
from triton_vlm.llm.model import DecoderModel, KVCache
from triton_vlm.llm.sampling import SamplingParams, make_generator, sample

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "cancelled", "error")
_PROMPT_CONTEXT_TOKENS = 5  # prompt tail used as detokenization context


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # None, "stop", "length", "cancelled", or "error"
    error: str | None = None          # set with finish_reason "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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


@dataclass
class _Sequence:
    request_id: str
    input_ids: torch.Tensor
    embeddings: torch.Tensor | None
    positions: torch.Tensor
    delta: int
    params: SamplingParams
    emit: Callable[[GenerationOutput], None]
    is_cancelled: Callable[[], bool]
    generator: torch.Generator
    detok: IncrementalDetokenizer
    cache: KVCache | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""   # stable detokenized text so far
    sent: int = 0    # characters of `text` emitted
    done: bool = False


def _as_tensor(value: Any, name: str, dtype: torch.dtype) -> torch.Tensor:
    try:
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", dtype)
        return torch.as_tensor(np.asarray(value), dtype=dtype)
    except Exception:
        raise InvalidInput(f"{name}: not a numeric array") from None


class Engine:
    """Serves one checkpoint's decoder. `submit` from any thread; emits come from the scheduler
    thread. Counters: `num_running`, `num_waiting`, `num_generated_tokens`, `num_finished`,
    `kv_cache_bytes` (bytes held by live KV caches)."""

    def __init__(self, checkpoint_dir: str | Path, *, max_running: int = 16, tokenizer=None,
                 model: DecoderModel | None = None):
        from tokenizers import Tokenizer

        self.checkpoint_dir = Path(checkpoint_dir)
        self.model = model or DecoderModel.from_checkpoint(self.checkpoint_dir)
        self.config = self.model.config
        self.tokenizer = tokenizer or Tokenizer.from_file(str(self.checkpoint_dir / "tokenizer.json"))
        self.eos_token_ids = frozenset(self.config.eos_token_ids)
        self.context_length = self.config.max_position_embeddings
        self.max_running = max(1, int(max_running))

        self.num_running = 0
        self.num_waiting = 0
        self.num_generated_tokens = 0
        self.num_finished = 0
        self.kv_cache_bytes = 0

        self._lock = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._ids_in_flight: set[str] = set()
        self._cancel_ids: set[str] = set()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="llm-scheduler", daemon=True)
        self._thread.start()

    # ---- public --------------------------------------------------------------------------------
    def submit(self, request_id: str, input_ids, embeddings, mrope_position_ids, mrope_position_delta,
               params: SamplingParams, emit: Callable[[GenerationOutput], None],
               is_cancelled: Callable[[], bool] = lambda: False) -> None:
        """Validate and queue a request; raises InvalidInput (nothing queued) if it cannot be served."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        c = self.config
        ids = _as_tensor(input_ids, "input_ids", torch.long).reshape(-1) if input_ids is not None else None
        if ids is None or ids.numel() == 0:
            raise InvalidInput("input_ids: empty prompt")
        n = int(ids.numel())
        if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
            raise InvalidInput(f"input_ids: token ids must be in [0, {c.vocab_size}), "
                               f"got {int(ids.min())}..{int(ids.max())}")
        if n + params.max_tokens > self.context_length:
            if n >= self.context_length:
                raise InvalidInput(f"prompt is {n} tokens, context is {self.context_length}")
            raise InvalidInput(f"prompt is {n} tokens and max_tokens is {params.max_tokens}, "
                               f"context is {self.context_length}")
        n_placeholders = int(sum(int((ids == t).sum()) for t in self.model.mm_token_ids))
        emb = None
        if embeddings is not None:
            emb = _as_tensor(embeddings, "embeddings", torch.float32)
            if emb.ndim == 3 and emb.shape[0] == 1:  # a leading batch dimension of 1
                emb = emb[0]
            if emb.numel() == 0:
                emb = None
            elif emb.ndim != 2 or emb.shape[1] != c.hidden_size:
                raise InvalidInput(f"embeddings: shape {list(emb.shape)}, expected "
                                   f"[{n_placeholders}, {c.hidden_size}]")
        n_rows = 0 if emb is None else int(emb.shape[0])
        if n_rows != n_placeholders:
            raise InvalidInput(f"embeddings: {n_rows} rows given, prompt has {n_placeholders} "
                               f"image/video placeholder tokens")
        if mrope_position_ids is None:  # text only: 1-D positions on all axes
            pos = torch.arange(n).expand(3, n).clone()
        else:
            pos = _as_tensor(mrope_position_ids, "mrope_position_ids", torch.long)
            if pos.ndim == 3 and pos.shape[1] == 1:
                pos = pos[:, 0]
            if tuple(pos.shape) != (3, n):
                raise InvalidInput(f"mrope_position_ids: shape {list(pos.shape)}, expected [3, {n}]")
        if mrope_position_delta is None:
            delta = int(pos.max()) + 1 - n
        else:
            d = _as_tensor(mrope_position_delta, "mrope_position_delta", torch.long).reshape(-1)
            if d.numel() != 1:
                raise InvalidInput(f"mrope_position_delta: shape {list(d.shape)}, expected [1]")
            delta = int(d[0])
        last_position = n + params.max_tokens - 1 + delta
        if last_position >= self.context_length:
            raise InvalidInput(f"prompt reaches position {last_position} with max_tokens "
                               f"{params.max_tokens}, context is {self.context_length}")

        request_id = str(request_id)
        tail = ids[-_PROMPT_CONTEXT_TOKENS:].tolist()
        seq = _Sequence(request_id=request_id, input_ids=ids, embeddings=emb, positions=pos, delta=delta,
                        params=params, emit=emit, is_cancelled=is_cancelled,
                        generator=make_generator(params.seed),
                        detok=IncrementalDetokenizer(self.tokenizer, tail))
        with self._lock:
            if self._stop:
                raise RuntimeError("engine is shut down")
            if request_id in self._ids_in_flight:
                raise InvalidInput(f"request id {request_id!r} is already in flight")
            self._ids_in_flight.add(request_id)
            self._waiting.append(seq)
            self.num_waiting = len(self._waiting)
            self._lock.notify_all()

    def cancel(self, request_id: str) -> None:
        """Ask the scheduler to end a request with finish_reason "cancelled" at its next step."""
        with self._lock:
            self._cancel_ids.add(str(request_id))
            self._lock.notify_all()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the scheduler thread; requests still in flight end with "cancelled"."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- scheduler -----------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            try:
                with self._lock:
                    while not self._stop and not self._waiting and not self._running:
                        self._lock.wait()
                    if self._stop:
                        break
                self._step()
            except Exception:  # a bug in the step itself: log, keep serving
                log.exception("llm scheduler step failed")
        self._drain()

    def _cancelled(self, seq: _Sequence) -> bool:
        if seq.request_id in self._cancel_ids:
            return True
        try:
            return bool(seq.is_cancelled())
        except Exception:
            log.exception("is_cancelled of request %s raised; cancelling it", seq.request_id)
            return True

    def _step(self) -> None:
        with self._lock:
            waiting = list(self._waiting)
        for seq in waiting:  # a cancelled request that has not started ends now
            if self._cancelled(seq):
                with self._lock:
                    self._waiting.remove(seq)
                    self.num_waiting = len(self._waiting)
                self._finish(seq, "cancelled")
        admitted = []
        with self._lock:
            while self._waiting and len(self._running) + len(admitted) < self.max_running:
                admitted.append(self._waiting.popleft())
            self.num_waiting = len(self._waiting)
        current = list(self._running)
        for seq in admitted:
            self._running.append(seq)
            self.num_running = len(self._running)
            self._advance(seq, prefill=True)
        for seq in current:
            if not seq.done:
                self._advance(seq, prefill=False)
        self._running = [s for s in self._running if not s.done]
        self.num_running = len(self._running)

    def _advance(self, seq: _Sequence, prefill: bool) -> None:
        try:
            if self._cancelled(seq):
                self._finish(seq, "cancelled")
                return
            if prefill:
                capacity = int(seq.input_ids.numel()) + seq.params.max_tokens
                logits, seq.cache = self.model.prefill(seq.input_ids, seq.embeddings, seq.positions,
                                                       capacity=capacity)
                self.kv_cache_bytes += seq.cache.nbytes
                seq.embeddings = None  # no longer needed
            else:
                k = len(seq.output_ids) - 1  # index of the generated token fed now
                position = int(seq.input_ids.numel()) + k + seq.delta
                logits = self.model.decode(seq.output_ids[-1], position, seq.cache)
            token = sample(logits, seq.params, seq.generator)
            self._on_token(seq, token)
        except InvalidInput as e:
            self._finish(seq, "error", error=str(e))
        except Exception as e:
            log.exception("request %s failed", seq.request_id)
            self._finish(seq, "error", error=f"internal error: {type(e).__name__}")

    def _on_token(self, seq: _Sequence, token: int) -> None:
        seq.output_ids.append(token)
        self.num_generated_tokens += 1
        seq.text += seq.detok.add(token)
        reason, stop_word_at = None, None
        if token in self.eos_token_ids:
            reason = "stop"
        if seq.params.stop_words:
            start = max(0, seq.sent - max(len(w) for w in seq.params.stop_words))
            hits = [i for i in (seq.text.find(w, start) for w in seq.params.stop_words) if i >= 0]
            if hits:
                reason, stop_word_at = "stop", min(hits)
        if reason is None and len(seq.output_ids) >= seq.params.max_tokens:
            reason = "length"
        if reason is None:
            # hold back a tail that may be the start of a stop word
            hold = 0
            for w in seq.params.stop_words:
                for n in range(min(len(w) - 1, len(seq.text)), hold, -1):
                    if seq.text.endswith(w[:n]):
                        hold = n
                        break
            end = max(seq.sent, len(seq.text) - hold)
            text, seq.sent = seq.text[seq.sent:end], end
            self._emit(seq, GenerationOutput([token], text))
            return
        if stop_word_at is None:
            seq.text += seq.detok.flush()
        self._finish(seq, reason, token_ids=[token], text_end=stop_word_at)

    def _emit(self, seq: _Sequence, out: GenerationOutput) -> None:
        try:
            seq.emit(out)
        except Exception:
            log.exception("emit of request %s raised; ending it", seq.request_id)
            if not out.finished:
                self._finish(seq, "error", error="emit failed")
            else:
                self._release(seq)

    def _release(self, seq: _Sequence) -> None:
        if seq.done:
            return
        seq.done = True
        if seq.cache is not None:
            self.kv_cache_bytes -= seq.cache.nbytes
            seq.cache.free()
            seq.cache = None
        seq.embeddings = None
        self.num_finished += 1
        with self._lock:
            self._ids_in_flight.discard(seq.request_id)
            self._cancel_ids.discard(seq.request_id)

    def _finish(self, seq: _Sequence, reason: str, token_ids: list[int] | None = None,
                text_end: int | None = None, error: str | None = None) -> None:
        if seq.done:
            return
        end = len(seq.text) if text_end is None else text_end
        text = seq.text[seq.sent:end] if reason in ("stop", "length") else ""
        seq.sent = max(seq.sent, end)
        out = GenerationOutput(list(token_ids or []), text, reason, error)
        self._release(seq)
        try:
            seq.emit(out)
        except Exception:
            log.exception("final emit of request %s raised", seq.request_id)

    def _drain(self) -> None:
        """After shutdown: every request still in flight ends with "cancelled"."""
        with self._lock:
            pending = list(self._waiting) + list(self._running)
            self._waiting.clear()
            self.num_waiting = 0
        self._running = []
        self.num_running = 0
        for seq in pending:
            self._finish(seq, "cancelled")
