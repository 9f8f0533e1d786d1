"""The `llm` step's engine: in-flight batching over a paged KV cache, one scheduler thread.

The engine is the loop that joins four parts, each one idea (as nano-vllm's and vLLM's engines):
- `BlockManager` (`block_manager.py`): which KV blocks and state slots belong to whom, prefix keys;
- `Scheduler` (`scheduler.py`): each step's plan (which sequences prefill which chunk, which
  decode), admission, preemption when blocks run out, the queue timeout;
- `ModelRunner` (`runner.py`): the KV cache and state tensors on the model's device, the step's
  batch and attention metadata built once, the forward pass, sampling;
- `OutputProcessor` (`output.py`): detokenisation, stop words, finish reasons, emits.
Guided decoding (`Grammars`, `grammar.py`) compiles a request's guide when it is checked, gives
it a matcher, whose mask the runner applies before sampling and which each sampled token advances.
`submit` checks a request (`InputProcessor`, `inputs.py`: INVALID_ARG before anything is queued or
taken) and queues it; the scheduler thread then runs steps while anything is waiting or running.
Its settings are `LLMOptions`' (`triton_vlm.contract.params`), the `llm` model's parameters. Cancellation (`cancel`,
or the request's `is_cancelled` where one is given) is noticed within one step. Each request gets exactly one final
emit, after its blocks are back; the thread logs exceptions and never dies of them.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from triton_vlm.contract.params import LLMOptions
from triton_vlm.devices import dtype_name
from triton_vlm.errors import InvalidInput, busy
from triton_vlm.llm.distributed.sharding import Shard
from triton_vlm.llm.engine.block_manager import BlockManager
from triton_vlm.llm.engine.fork import with_forks
from triton_vlm.llm.engine.grammar import Grammars
from triton_vlm.llm.engine.inputs import InputProcessor
from triton_vlm.llm.engine.output import OutputProcessor
from triton_vlm.llm.engine.runner import ModelRunner
from triton_vlm.llm.engine.sampling import NO_ALLOWED_TOKEN, NO_TOKEN, SamplingParams, make_generator
from triton_vlm.llm.engine.scheduler import Scheduler, SchedulerOutput
from triton_vlm.llm.engine.sequence import Sequence, SequenceGroup
from triton_vlm.llm.engine.streaming import GenerationOutput, IncrementalDetokenizer
from triton_vlm.llm.engine.tensor_parallel import WorkerGone, Workers
from triton_vlm.llm.model import DecoderModel
from triton_vlm.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

_PROMPT_CONTEXT_TOKENS = 5  # prompt tail used as detokenization context
_EARLY_STOPS = 256  # stops kept for request ids not (yet) in flight
DEFAULT_KV_CACHE_BYTES = 256 << 20


class Engine:
    """Serves one checkpoint's decoder. `submit` from any thread; emits come from the scheduler
    thread. Counters: `num_running`, `num_waiting`, `num_generated_tokens`, `num_finished`,
    `num_preempted`, `num_steps`; the blocks in use and free (`kv_blocks_used`, `kv_blocks_free`).

    KV cache size: `kv_cache_tokens`, else `kv_cache_bytes` (default 256 MiB), rounded down to blocks.
    `queue_timeout_ms` (0: none) bounds the wait for a first place in the batch, timed by `clock`.
    `prefix_caching` is ignored (off) for decoders with a recurrent state (`prefix_caching` tells).
    `device` (cpu, cuda, cuda:N) and `dtype` (float32, bfloat16, float16) place the model loaded
    here, the KV cache and every tensor of a step (a given `model` keeps its own); the KV cache is in
    the model's dtype (`kv_bytes_per_token`). On CUDA, `cuda_graphs` captures the decode step at
    batch-size buckets up to `max_running` (`triton_vlm.llm.engine.cuda_graphs`; ignored on CPU)."""

    def __init__(self, checkpoint_dir: str | Path, *, model: DecoderModel | None = None, tokenizer=None,
                 return_logits: bool = False, clock: Callable[[], float] = time.monotonic,
                 on_failure: Callable[[str], None] | None = None, **settings: Any):
        """`settings`: the fields of `LLMOptions` (the `llm` model's parameters, declared there
        once: device, dtype, KV cache size and block size, prefix caching, max_running,
        max_num_tokens, queue_timeout_ms, cuda_graphs, mixed_steps, paged_prefill, tensor_parallel); an
        unknown name is a TypeError. `on_failure(message)` is called (on the scheduler thread) when
        the engine can serve no more: a tensor-parallel worker exited."""
        self.checkpoint_dir = Path(checkpoint_dir)
        self.settings = LLMOptions(**settings)
        self.clock = clock
        self.num_running = 0
        self.num_waiting = 0
        self.num_finished = 0
        self.num_steps = 0
        self.failed: str | None = None  # why the engine serves no more (a tensor-parallel worker exited)
        self._on_failure = on_failure

        self._lock = threading.Condition()
        self._incoming: deque[Sequence] = deque()   # submitted, not yet seen by the scheduler
        self._arrivals = 0
        self._ids_in_flight: set[str] = set()
        self._cancel_ids: set[str] = set()
        self._early_stops: OrderedDict[str, None] = OrderedDict()
        self._stop = False
        # The model, the caches and every step's tensors are made on the scheduler thread: with
        # libgomp, a second thread that runs parallel regions (the caller's, loading weights) keeps
        # a pool of OpenMP workers of its own, and once a process manages more OpenMP threads than
        # cores every region's wake-up slows several-fold (bench/RESULTS.md, "OpenMP").
        build = partial(self._build, model=model, tokenizer=tokenizer, return_logits=return_logits)
        built: list[BaseException | None] = []
        ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(build, built, ready), name="llm-scheduler",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        if built[0] is not None:
            self._thread.join()
            raise built[0]

    def _build(self, *, model: DecoderModel | None, tokenizer, return_logits: bool) -> None:
        """Everything that holds tensors: the model (loaded here unless given), the KV cache, the
        scheduler, the runner and the output processor. Runs on the scheduler thread."""
        s = self.settings
        self.model = model or DecoderModel.from_checkpoint(self.checkpoint_dir, device=s.device, dtype=s.dtype,
                                                           shard=Shard(0, s.tensor_parallel))
        self.config = c = self.model.config
        self.kv_bytes_per_token = c.kv_bytes_per_token(self.model.dtype)
        self.tokenizer = tokenizer or load_tokenizer(self.checkpoint_dir)
        self.eos_token_ids = frozenset(self.config.eos_token_ids)
        self.context_length = self.config.max_position_embeddings
        self.return_logits = bool(return_logits)
        if s.kv_cache_tokens:
            tokens = int(s.kv_cache_tokens)
        else:
            tokens = int(s.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // self.kv_bytes_per_token
        block_size = int(s.block_size)
        num_blocks = tokens // block_size
        if num_blocks < 1:
            raise ValueError(f"KV cache of {tokens} tokens holds no block of {block_size}")
        if s.prefix_caching and c.recurrent:
            log.info("prefix caching is off: %s has linear-attention layers (a recurrent state per sequence)",
                     c.family)
        self.prefix_caching = bool(s.prefix_caching) and not c.recurrent
        max_running = max(1, int(s.max_running))
        self.blocks = BlockManager(num_blocks, block_size, self.prefix_caching,
                                   state_slots=max_running if c.recurrent else 0)
        self.scheduler = Scheduler(self.blocks, max_running=max_running, max_num_tokens=s.max_num_tokens,
                                   recurrent=c.recurrent, queue_timeout_ms=s.queue_timeout_ms,
                                   mixed_steps=s.mixed_steps, clock=self.clock)
        workers = None
        if self.model.shard.world > 1:  # the other ranks, each with its shard and a KV cache of as many blocks
            workers = Workers(self.checkpoint_dir, self.model.shard.world, self.model.device,
                              dtype_name(self.model.dtype), num_blocks, block_size, max_running)
        self.runner = ModelRunner(self.model, num_blocks, block_size, max_batch=max_running,
                                  cuda_graphs=s.cuda_graphs, max_context=self.context_length,
                                  paged_prefill=s.paged_prefill, workers=workers)
        self.output = OutputProcessor(self._release)
        log.info("llm KV cache: %d blocks x %d tokens, %d bytes per token (%s on %s), %.1f MiB", num_blocks,
                 block_size, self.kv_bytes_per_token, dtype_name(self.model.dtype), self.model.device,
                 self.runner.kv.nbytes / (1 << 20))
        self.pool_tokens = num_blocks * block_size
        self.grammars = Grammars(self.tokenizer, c.vocab_size, self.eos_token_ids)
        self.inputs = InputProcessor(self.model, self.eos_token_ids,
                                     lambda word: self.tokenizer.encode(word, add_special_tokens=False).ids,
                                     self.context_length, self.pool_tokens, block_size, self.prefix_caching,
                                     self.grammars)

    # ---- counters ------------------------------------------------------------------------------
    @property
    def kv_blocks_used(self) -> int:
        return self.blocks.num_used

    @property
    def kv_blocks_free(self) -> int:
        return self.blocks.num_free

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache held by live sequences."""
        return self.blocks.num_used * self.blocks.block_size * self.kv_bytes_per_token

    @property
    def num_generated_tokens(self) -> int:
        return self.output.num_generated_tokens

    @property
    def num_preempted(self) -> int:
        return self.scheduler.num_preempted

    # ---- public --------------------------------------------------------------------------------
    def submit(self, request_id: str, input_ids, embeddings, mrope_position_ids, mrope_position_delta,
               params: SamplingParams, emit: Callable[[GenerationOutput], None],
               is_cancelled: Callable[[], bool] | None = None, media_position_ids=None, kept_rows=None) -> None:
        """Check (`triton_vlm.llm.engine.inputs`) and queue a request; raises InvalidInput (nothing queued, no
        block taken) if it cannot be served. `is_cancelled`, where given, is asked before every step
        (a caller whose answer costs a round trip asks it elsewhere and calls `cancel`: the served
        llm's `Outbox`). With EVS pruning, `media_position_ids` (every unpruned media token's
        position) and `kept_rows` (each embedding row's index among them) finish the positions of
        the media tokens and the delta (`triton_vlm.media.mrope.complete_positions`)."""
        prompt = self.inputs(input_ids, embeddings, mrope_position_ids, mrope_position_delta, params,
                             media_position_ids, kept_rows)
        request_id = str(request_id)
        tail = prompt.ids[-_PROMPT_CONTEXT_TOKENS:].tolist()
        seq = Sequence(request_id=request_id, prompt_len=int(prompt.ids.numel()), tokens=prompt.ids.tolist(),
                       embeddings=prompt.embeddings, emb_index=prompt.emb_index, positions=prompt.positions,
                       delta=prompt.delta, params=prompt.params, emit=emit, is_cancelled=is_cancelled,
                       generator=make_generator(prompt.params.seed, self.runner.device),
                       detok=IncrementalDetokenizer(self.tokenizer, tail), keys=prompt.keys, spans=prompt.spans,
                       queued_since=self.clock(),
                       grammar=None if prompt.grammar is None else
                       self.grammars.matcher(prompt.grammar, prompt.params.eos_token_ids),
                       group=None if prompt.params.num_return_sequences == 1 else
                       SequenceGroup(to_fork=prompt.params.num_return_sequences - 1))
        with self._lock:
            if self._stop:
                raise RuntimeError("engine is shut down")
            if self.failed:
                raise RuntimeError(self.failed)
            if request_id in self._ids_in_flight:
                raise InvalidInput(f"request id {request_id!r} is already in flight")
            self._ids_in_flight.add(request_id)
            if request_id in self._early_stops:
                del self._early_stops[request_id]
                self._cancel_ids.add(request_id)
            self._arrivals += 1
            seq.arrival = self._arrivals
            self._incoming.append(seq)
            self.num_waiting += 1
            self._lock.notify_all()

    def cancel(self, request_id: str, early: bool = True) -> None:
        """Ask the scheduler to end a request with finish_reason "cancelled" at its next step. A stop
        may overtake its request (they come on different calls): one for an id not in flight is
        kept for the next request of that id (unless not `early`: a request seen cancelled may have
        ended meanwhile), the latest `_EARLY_STOPS` of them, so that stops for ids that never come
        cannot grow without bound."""
        request_id = str(request_id)
        with self._lock:
            if request_id in self._ids_in_flight:
                self._cancel_ids.add(request_id)
            elif early:
                self._early_stops[request_id] = None
                self._early_stops.move_to_end(request_id)
                while len(self._early_stops) > _EARLY_STOPS:
                    self._early_stops.popitem(last=False)
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

    # ---- scheduler thread ----------------------------------------------------------------------
    def _loop(self, build: Callable[[], None], built: list, ready: threading.Event) -> None:
        try:
            build()
            built.append(None)
        except BaseException as error:  # raised again by __init__
            built.append(error)
            return
        finally:
            ready.set()
        torch.set_grad_enabled(False)
        if self.runner.device.type == "cuda":  # Triton launches its kernels on the current device
            torch.cuda.set_device(self.runner.device)
            # the host's tensor ops of a step are tiny: one thread, no OpenMP team to wake for each
            torch.set_num_threads(1)
        while True:
            try:
                with self._lock:
                    while not self._stop and not self._incoming and not self.scheduler:
                        self._lock.wait()
                    if self._stop:
                        break
                    for seq in self._incoming:
                        self.scheduler.add(seq)
                    self._incoming.clear()
                self._step()
            except Exception:  # a bug in the step itself: log, keep serving
                log.exception("llm scheduler step failed")
        self._drain()
        if self.runner.workers is not None:
            self.runner.workers.stop()

    def _cancelled(self, seq: Sequence) -> bool:
        if seq.request_id in self._cancel_ids:
            return True
        if seq.is_cancelled is None:
            return False
        try:
            return bool(seq.is_cancelled())
        except Exception:
            log.exception("is_cancelled of request %s raised; cancelling it", seq.request_id)
            return True

    def _update_counts(self) -> None:
        self.num_running = len(self.scheduler.running)
        with self._lock:
            self.num_waiting = len(self.scheduler.waiting) + len(self._incoming)

    def _step(self) -> None:
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:  # cancellation noticed within one step
            if self._cancelled(seq):
                self.output.finish(seq, "cancelled")
        out = self.scheduler.schedule()
        for seq, waited_ms in out.overdue:
            self.output.finish(seq, "rejected", error=busy(
                f"waited {waited_ms:.0f} ms for a place in the llm batch, "
                f"llm_queue_timeout_ms={self.scheduler.queue_timeout_ms:g}"))
        self._update_counts()
        if out.chunks:
            self._run(out)
        self._update_counts()

    def _run(self, out: SchedulerOutput) -> None:
        try:
            logits = self.runner.forward(out.chunks)
        except Exception as e:
            log.exception("llm forward pass failed for %d requests", len(out.chunks))
            gone = self._workers_gone()
            if gone:  # every request, this step's too, ends with why
                self._fail(gone)
                return
            for c in out.chunks:
                self.output.finish(c.seq, "error", error=f"internal error: {type(e).__name__}")
            return
        self.num_steps += 1
        self.scheduler.advance(out)
        sampling, logits = with_forks([c.seq for c in out.chunks if c.samples], logits, self.blocks,
                                      self.config.recurrent, self.tokenizer, self.scheduler.waiting)
        try:
            tokens, logprobs = self.runner.sample(sampling, logits)
        except Exception as e:
            log.exception("sampling failed for %d requests", len(sampling))
            for seq in sampling:
                self.output.finish(seq, "error", error=f"internal error: {type(e).__name__}")
            return
        host_logits = logits.cpu() if self.return_logits else None
        for i, (seq, token, logprob) in enumerate(zip(sampling, tokens, logprobs)):
            if token == NO_TOKEN:
                log.error("request %s: its logits are not finite, no token to sample", seq.request_id)
                self.output.finish(seq, "error", error="internal error: non-finite logits")
                continue
            if token == NO_ALLOWED_TOKEN:
                self.output.finish(seq, "error", error="guided decoding: its grammar and min_tokens / bad_words "
                                                       "leave no token to sample")
                continue
            if seq.grammar is not None and not seq.grammar.accept_token(token):
                log.error("request %s: its grammar refused the sampled token %d", seq.request_id, token)
                self.output.finish(seq, "error", error="internal error: the grammar refused a sampled token")
                continue
            try:
                self.output.on_token(seq, token, None if host_logits is None else host_logits[i], logprob)
            except Exception as e:
                log.exception("request %s failed", seq.request_id)
                self.output.finish(seq, "error", error=f"internal error: {type(e).__name__}")

    def _workers_gone(self) -> str | None:
        """Why the tensor-parallel group broke (a worker exited), or None."""
        if self.runner.workers is None:
            return None
        try:
            self.runner.workers.check(wait=2.0)
        except WorkerGone as gone:
            return str(gone)
        return None

    def _fail(self, message: str) -> None:
        """The engine can serve no more: every request ends with `message`, new ones are refused."""
        log.error("llm engine failed: %s", message)
        with self._lock:
            self.failed = message
            pending = list(self._incoming)
            self._incoming.clear()
        for seq in [*pending, *self.scheduler.waiting, *self.scheduler.running]:
            self.output.finish(seq, "error", error=message)
        self._update_counts()
        if self._on_failure is not None:
            self._on_failure(message)

    def _release(self, seq: Sequence) -> None:
        """Before a request's final emit: its blocks and state slot go back, its id is free again."""
        self.scheduler.finish(seq)
        seq.embeddings = seq.emb_index = seq.grammar = None
        self.num_running = len(self.scheduler.running)
        self.num_finished += 1
        if seq.group is not None and not seq.group.leave():  # the request goes on in another sequence
            return
        with self._lock:
            self._ids_in_flight.discard(seq.request_id)
            self._cancel_ids.discard(seq.request_id)

    def _drain(self) -> None:
        """After shutdown: every request still in flight ends with "cancelled"."""
        with self._lock:
            pending = list(self._incoming)
            self._incoming.clear()
        pending += [*self.scheduler.waiting, *self.scheduler.running]
        for seq in pending:
            self.output.finish(seq, "cancelled")
        self._update_counts()
