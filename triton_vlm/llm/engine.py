"""The `llm` step's engine: in-flight batching over a paged KV cache, one scheduler thread.

Every step (one batched forward pass) the scheduler, oldest request first:
- gives each running sequence its next rows within a per-step token budget (`max_num_tokens`):
  one token for a decoding sequence, the next chunk of the prompt for one still in prefill;
- admits waiting requests into the remaining budget (they join the running batch right away),
  reusing cached prompt-prefix blocks when prefix caching is on;
- takes KV blocks from the pool as rows need them. When the pool is out of blocks, a waiting
  request keeps waiting, and a running one that needs a block preempts the newest running
  sequence (its blocks go back; it is recomputed later from its prompt and the tokens it already
  has, with its sampler state kept, so its output does not change). Nothing fails for lack of
  blocks;
- with `queue_timeout_ms`, finishes a request that is still waiting for its first place in the
  batch after that long with "rejected" (the server answers UNAVAILABLE: overload is a quick
  refusal, not an unbounded wait). A preempted request has had its place and is never rejected.
Decoders with linear-attention layers (`DecoderConfig.recurrent`) also give every running sequence
a slot of the pool's `StatePool` (taken when it starts running, given back with its blocks: on
finish, cancel, error and preemption); prefix caching is off for them (see `triton_vlm.llm.paged`).
Then one `DecoderModel.forward` runs every row, and each sequence whose rows reached its end
samples its next token with its own generator.

Each request gets exactly one final emit (`finish_reason` set): on stop, length, cancel, shutdown,
queue timeout ("rejected"), or an error inside the loop ("error"; both with `error` set); its
blocks are back in the pool before that emit. The thread logs exceptions and never dies of them.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from triton_vlm.errors import InvalidInput, busy
from triton_vlm.llm.device import dtype_name
from triton_vlm.llm.model import Chunk, DecoderModel
from triton_vlm.llm.paged import KVPool, block_keys
from triton_vlm.llm.sampling import SamplingParams, make_generator, sample

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "cancelled", "rejected", "error")
_PROMPT_CONTEXT_TOKENS = 5  # prompt tail used as detokenization context
DEFAULT_KV_CACHE_BYTES = 256 << 20


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # None or one of FINISH_REASONS
    error: str | None = None          # set with finish_reason "rejected" or "error"
    logits: torch.Tensor | None = None  # the sampled step's logits, with Engine(return_logits=True)

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
    arrival: int
    prompt_len: int
    tokens: list[int]                 # prompt ids, then generated ids
    embeddings: torch.Tensor | None   # placeholder rows (kept for recompute after preemption)
    emb_index: torch.Tensor | None    # per prompt position: row of `embeddings`, or -1
    positions: torch.Tensor           # [3, prompt_len]
    delta: int
    params: SamplingParams
    emit: Callable[[GenerationOutput], None]
    is_cancelled: Callable[[], bool]
    generator: torch.Generator
    detok: IncrementalDetokenizer
    keys: list[bytes] = field(default_factory=list)   # prefix-cache keys of full prompt blocks
    blocks: list[int] = field(default_factory=list)   # block table
    state: int | None = None          # StatePool slot while running
    num_computed: int = 0             # tokens whose K/V are in the blocks
    text: str = ""   # stable detokenized text so far
    sent: int = 0    # characters of `text` emitted
    done: bool = False
    queued_since: float | None = None  # submit time; None from its first place in the batch on (preempted too)


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
    `num_preempted`; the pool's `num_used` / `num_free` blocks (`kv_blocks_used`, `kv_blocks_free`).

    Pool size: `kv_cache_tokens`, else `kv_cache_bytes` (default 256 MiB), rounded down to blocks.
    `queue_timeout_ms` (0: none) bounds the wait for a first place in the batch, timed by `clock`.
    `prefix_caching` is ignored (off) for decoders with a recurrent state (`prefix_caching` tells).
    On top of the pool, decode steps keep dense copies of the decoding sequences' K/V
    (`pool.decode_cache`: at most half the pool's bytes, grown on demand, freed when nothing runs).
    `device` (cpu, cuda, cuda:N) and `dtype` (float32, bfloat16, float16) place the model loaded
    here, the pool and every tensor of a step (a given `model` keeps its own); the KV pool is in the
    model's dtype (`kv_bytes_per_token`). Sampling runs on CPU on float32 logits."""

    def __init__(self, checkpoint_dir: str | Path, *, max_running: int = 64, tokenizer=None,
                 model: DecoderModel | None = None, kv_cache_tokens: int | None = None,
                 kv_cache_bytes: int | None = None, block_size: int = 16, prefix_caching: bool = False,
                 max_num_tokens: int = 512, return_logits: bool = False, queue_timeout_ms: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, device: str = "cpu",
                 dtype: str | torch.dtype = "float32"):
        from tokenizers import Tokenizer

        self.checkpoint_dir = Path(checkpoint_dir)
        self.model = model or DecoderModel.from_checkpoint(self.checkpoint_dir, device=device, dtype=dtype)
        self.config = c = self.model.config
        self.kv_bytes_per_token = c.kv_bytes_per_token(self.model.dtype)
        self.tokenizer = tokenizer or Tokenizer.from_file(str(self.checkpoint_dir / "tokenizer.json"))
        self.eos_token_ids = frozenset(self.config.eos_token_ids)
        self.context_length = self.config.max_position_embeddings
        self.max_running = max(1, int(max_running))
        self.max_num_tokens = max(1, int(max_num_tokens))
        self.return_logits = bool(return_logits)
        if queue_timeout_ms < 0:
            raise ValueError(f"queue_timeout_ms must be >= 0, got {queue_timeout_ms}")
        self.queue_timeout_ms = float(queue_timeout_ms)
        self.clock = clock
        if kv_cache_tokens:
            tokens = int(kv_cache_tokens)
        else:
            tokens = int(kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // self.kv_bytes_per_token
        num_blocks = tokens // int(block_size)
        if num_blocks < 1:
            raise ValueError(f"KV pool of {tokens} tokens holds no block of {block_size}")
        if prefix_caching and c.recurrent:
            log.info("prefix caching is off: %s has linear-attention layers (a recurrent state per sequence)",
                     c.model_type)
        self.prefix_caching = bool(prefix_caching) and not c.recurrent
        self.pool = KVPool.for_model(c, num_blocks * int(block_size), block_size, self.prefix_caching,
                                     state_slots=self.max_running, dtype=self.model.dtype, device=self.model.device)
        self.pool_tokens = num_blocks * int(block_size)
        log.info("llm KV cache: %d blocks x %d tokens, %d bytes per token (%s on %s), %.1f MiB", num_blocks,
                 block_size, self.kv_bytes_per_token, dtype_name(self.model.dtype), self.model.device,
                 self.pool.nbytes / (1 << 20))

        self.num_running = 0
        self.num_waiting = 0
        self.num_generated_tokens = 0
        self.num_finished = 0
        self.num_preempted = 0
        self.num_steps = 0

        self._lock = threading.Condition()
        self._incoming: deque[_Sequence] = deque()   # submitted, not yet seen by the scheduler
        self._waiting: deque[_Sequence] = deque()    # scheduler-owned
        self._running: list[_Sequence] = []          # scheduler-owned, arrival order
        self._arrivals = 0
        self._ids_in_flight: set[str] = set()
        self._cancel_ids: set[str] = set()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="llm-scheduler", daemon=True)
        self._thread.start()

    # ---- counters ------------------------------------------------------------------------------
    @property
    def kv_blocks_used(self) -> int:
        return self.pool.num_used

    @property
    def kv_blocks_free(self) -> int:
        return self.pool.num_free

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the pool held by live sequences."""
        return self.pool.num_used * self.pool.block_size * self.kv_bytes_per_token

    # ---- public --------------------------------------------------------------------------------
    def submit(self, request_id: str, input_ids, embeddings, mrope_position_ids, mrope_position_delta,
               params: SamplingParams, emit: Callable[[GenerationOutput], None],
               is_cancelled: Callable[[], bool] = lambda: False) -> None:
        """Validate and queue a request; raises InvalidInput (nothing queued, no block taken) if it
        cannot be served."""
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
        if n + params.max_tokens > self.pool_tokens:
            raise InvalidInput(f"prompt is {n} tokens and max_tokens is {params.max_tokens}, "
                               f"the KV cache pool holds {self.pool_tokens} tokens")
        emb = None
        if embeddings is not None:
            emb = _as_tensor(embeddings, "embeddings", torch.float32)
            if emb.ndim == 3 and emb.shape[0] == 1:  # a leading batch dimension of 1
                emb = emb[0]
        mask, emb = self.model.placeholder_rows(ids, emb)
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
        emb_index = None
        if emb is not None:
            emb_index = torch.full((n,), -1, dtype=torch.long)
            emb_index[mask] = torch.arange(emb.shape[0])
        keys = block_keys(ids, pos, emb, mask, self.pool.block_size) if self.pool.prefix_caching else []
        if emb is not None:  # keyed by the float32 rows above; cast once for the model
            emb = emb.to(self.model.device, self.model.dtype)

        request_id = str(request_id)
        tail = ids[-_PROMPT_CONTEXT_TOKENS:].tolist()
        seq = _Sequence(request_id=request_id, arrival=0, prompt_len=n, tokens=ids.tolist(), embeddings=emb,
                        emb_index=emb_index, positions=pos, delta=delta, params=params, emit=emit,
                        is_cancelled=is_cancelled, generator=make_generator(params.seed),
                        detok=IncrementalDetokenizer(self.tokenizer, tail), keys=keys,
                        queued_since=self.clock())
        with self._lock:
            if self._stop:
                raise RuntimeError("engine is shut down")
            if request_id in self._ids_in_flight:
                raise InvalidInput(f"request id {request_id!r} is already in flight")
            self._ids_in_flight.add(request_id)
            self._arrivals += 1
            seq.arrival = self._arrivals
            self._incoming.append(seq)
            self.num_waiting += 1
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
                    while not self._stop and not self._incoming and not self._waiting and not self._running:
                        self._lock.wait()
                    if self._stop:
                        break
                    self._waiting.extend(self._incoming)
                    self._incoming.clear()
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

    def _update_counts(self) -> None:
        self._running = [s for s in self._running if not s.done]
        self._waiting = deque(s for s in self._waiting if not s.done)
        self.num_running = len(self._running)
        with self._lock:
            self.num_waiting = len(self._waiting) + len(self._incoming)

    def _preempt(self, seq: _Sequence) -> None:
        """Give the blocks (and state slot) back; the sequence waits (first in line) to be recomputed."""
        self.pool.release(seq.blocks)
        seq.blocks, seq.num_computed = [], 0
        self._release_state(seq)
        self._running.remove(seq)
        self._waiting.appendleft(seq)
        self.num_preempted += 1

    def _grow(self, seq: _Sequence, end: int, planned: set[int]) -> bool:
        """Blocks for tokens up to `end`, preempting the newest unplanned running sequence as
        needed; False if `seq` itself had to be preempted."""
        need = self.pool.blocks_for(end) - len(seq.blocks)
        while need > 0:
            got = self.pool.allocate(need)
            if got is not None:
                seq.blocks.extend(got)
                return True
            victim = next((s for s in reversed(self._running) if id(s) not in planned and not s.done), seq)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _step(self) -> None:
        for seq in [*self._waiting, *self._running]:  # cancellation noticed within one step
            if not seq.done and self._cancelled(seq):
                self._finish(seq, "cancelled")
        self._update_counts()
        budget = self.max_num_tokens
        plan: list[tuple[_Sequence, int, int]] = []
        planned: set[int] = set()
        for seq in list(self._running):
            if budget <= 0:
                break
            if seq.done or seq not in self._running:  # preempted meanwhile
                continue
            start = seq.num_computed
            end = min(len(seq.tokens), start + budget)
            if self._grow(seq, end, planned):
                plan.append((seq, start, end))
                planned.add(id(seq))
                budget -= end - start
        while self._waiting and budget > 0 and len(self._running) < self.max_running:
            seq = self._waiting[0]
            fresh = not seq.blocks
            if fresh and seq.keys:  # reuse cached prompt blocks; at least one token is computed
                seq.blocks = self.pool.lookup(seq.keys[:(len(seq.tokens) - 1) // self.pool.block_size])
                seq.num_computed = len(seq.blocks) * self.pool.block_size
            start = seq.num_computed
            end = min(len(seq.tokens), start + budget)
            got = self.pool.allocate(self.pool.blocks_for(end) - len(seq.blocks))
            if got is None:  # out of blocks: it keeps waiting, first in line
                if fresh:
                    self.pool.release(seq.blocks)
                    seq.blocks, seq.num_computed = [], 0
                break
            seq.blocks.extend(got)
            seq.queued_since = None
            seq.state = self.pool.states.allocate()  # running sequences <= max_running = slots
            self._waiting.popleft()
            self._running.append(seq)
            self._running.sort(key=lambda s: s.arrival)
            plan.append((seq, start, end))
            planned.add(id(seq))
            budget -= end - start
        if self.queue_timeout_ms:
            self._reject_overdue()
        self._update_counts()
        if plan:
            self._run(plan)
        self._update_counts()

    def _reject_overdue(self) -> None:
        """After the step's admissions: a request still waiting for its first place longer than
        `queue_timeout_ms` ends with "rejected" (it holds no block)."""
        now = self.clock()
        for seq in self._waiting:
            if seq.queued_since is None:
                continue
            waited_ms = (now - seq.queued_since) * 1000.0
            if waited_ms > self.queue_timeout_ms:
                self._finish(seq, "rejected", error=busy(f"waited {waited_ms:.0f} ms for a place in the llm batch, "
                                                         f"llm_queue_timeout_ms={self.queue_timeout_ms:g}"))

    def _chunk(self, seq: _Sequence, start: int, end: int) -> Chunk:
        n = seq.prompt_len
        ids = torch.tensor(seq.tokens[start:end], dtype=torch.long, device=self.model.device)
        h = F.embedding(ids, self.model.embed_tokens)
        if start < n and seq.emb_index is not None:
            idx = seq.emb_index[start:min(end, n)]
            m = idx >= 0
            if bool(m.any()):
                rows = h[:idx.numel()]
                rows[m] = seq.embeddings[idx[m]]
        parts = []
        if start < n:
            parts.append(seq.positions[:, start:min(end, n)])
        if end > n:
            parts.append((torch.arange(max(start, n), end) + seq.delta).expand(3, -1))
        positions = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return Chunk(h, positions, start, self.pool.slots(seq.blocks, end), want_logits=end == len(seq.tokens),
                     key=seq.arrival, state=seq.state)

    def _run(self, plan: list[tuple[_Sequence, int, int]]) -> None:
        try:
            chunks = [self._chunk(seq, start, end) for seq, start, end in plan]
            logits = self.model.forward(chunks, self.pool).cpu()
        except Exception as e:
            log.exception("llm forward pass failed for %d requests", len(plan))
            for seq, _, _ in plan:
                self._finish(seq, "error", error=f"internal error: {type(e).__name__}")
            return
        self.num_steps += 1
        row = 0
        bs = self.pool.block_size
        for seq, start, end in plan:
            seq.num_computed = end
            if seq.keys:  # newly completed prompt blocks become reusable
                for j in range(start // bs, min(end, seq.prompt_len) // bs):
                    self.pool.register(seq.blocks[j], seq.keys[j])
            if end != len(seq.tokens):
                continue
            row_logits = logits[row]
            row += 1
            try:
                ctx = torch.tensor(seq.tokens) if seq.params.repetition_penalty != 1.0 else None
                token = sample(row_logits, seq.params, seq.generator, ctx)
                self._on_token(seq, token, row_logits if self.return_logits else None)
            except Exception as e:
                log.exception("request %s failed", seq.request_id)
                self._finish(seq, "error", error=f"internal error: {type(e).__name__}")

    def _on_token(self, seq: _Sequence, token: int, logits: torch.Tensor | None = None) -> None:
        seq.tokens.append(token)
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
        if reason is None and len(seq.tokens) - seq.prompt_len >= seq.params.max_tokens:
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
            self._emit(seq, GenerationOutput([token], text, logits=logits))
            return
        if stop_word_at is None:
            seq.text += seq.detok.flush()
        self._finish(seq, reason, token_ids=[token], text_end=stop_word_at, logits=logits)

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
        if seq.blocks:
            self.pool.release(seq.blocks)
            seq.blocks = []
        self._release_state(seq)
        seq.embeddings = seq.emb_index = None
        self.num_running = sum(1 for s in self._running if not s.done)
        if self.num_running == 0:  # nothing decoding: the dense decode copies go too
            self.pool.decode_cache.clear()
        self.num_finished += 1
        with self._lock:
            self._ids_in_flight.discard(seq.request_id)
            self._cancel_ids.discard(seq.request_id)

    def _release_state(self, seq: _Sequence) -> None:
        if seq.state is not None:
            self.pool.states.release(seq.state)
            seq.state = None

    def _finish(self, seq: _Sequence, reason: str, token_ids: list[int] | None = None,
                text_end: int | None = None, error: str | None = None,
                logits: torch.Tensor | None = None) -> None:
        if seq.done:
            return
        end = len(seq.text) if text_end is None else text_end
        text = seq.text[seq.sent:end] if reason in ("stop", "length") else ""
        seq.sent = max(seq.sent, end)
        out = GenerationOutput(list(token_ids or []), text, reason, error, logits)
        self._release(seq)
        try:
            seq.emit(out)
        except Exception:
            log.exception("final emit of request %s raised", seq.request_id)

    def _drain(self) -> None:
        """After shutdown: every request still in flight ends with "cancelled"."""
        with self._lock:
            pending = list(self._incoming) + list(self._waiting) + list(self._running)
            self._incoming.clear()
            self._waiting.clear()
            self.num_waiting = 0
        self._running = []
        self.num_running = 0
        for seq in pending:
            self._finish(seq, "cancelled")
