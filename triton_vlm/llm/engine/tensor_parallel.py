"""Tensor-parallel execution of the llm: one engine drives N ranks, nano-vllm's way.

Rank 0 is the engine's own model runner: it schedules, builds each step's inputs, samples. Ranks
1 .. N-1 are worker processes it spawns (`Workers`; each runs `worker_main`), each holding its
shard of the weights (`triton_vlm.llm.distributed.sharding`) and of the KV cache (its KV heads, the
same blocks as rank 0: the block manager's tables hold for every rank). Each step rank 0 broadcasts
what a worker cannot know (`send`): the step's input rows (embeddings, vision rows already in
place), positions, each sequence's rows and block table, the rows that sample; then every rank runs
the same forward pass, the row-parallel layers all-reducing their partial sums, and the LM head's
vocabulary shards are gathered on rank 0. torch.distributed over gloo on the CPU, NCCL on CUDA
(rank r on the GPU after rank 0's, r places on).

A worker that dies fails the step that needed it (the collective raises), and the runner stays
failed (`WorkerGone`): the engine ends every request with that error and refuses new ones; served
by Triton, the `llm` model then exits its stub so that `triton-vlm serve` reloads it.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from triton_vlm.contract.params import PYTHON_ENV
from triton_vlm.llm.attention.base import SeqRows
from triton_vlm.llm.distributed.collectives import init_group, loopback_listener, rank_device
from triton_vlm.llm.distributed.sharding import Shard
from triton_vlm.llm.engine.runner import ModelRunner
from triton_vlm.llm.layers.linear_attention import RecurrentRows
from triton_vlm.llm.model import DecoderModel, DeepStack, StepBatch

log = logging.getLogger(__name__)

STOP, STEP = 0, 1


class WorkerGone(RuntimeError):
    """A tensor-parallel worker exited: the runner cannot run a step any more."""


# ---- one step's message ----------------------------------------------------------------------------
def send(pipes: list, h: torch.Tensor, positions: torch.Tensor, seqs: list[SeqRows], recurrent: RecurrentRows | None,
         logits_rows: torch.Tensor, block_size: int, deepstack: DeepStack | None = None) -> None:
    """Rank 0: a step to the workers: its sequences, their linear-attention rows and state slots,
    its sampling rows and its DeepStack rows on each worker's pipe, then its input rows h [T, hidden],
    positions [3, T] and DeepStack maps broadcast."""
    tables = [s.blocks[:-(-(s.start + s.n) // block_size)] for s in seqs]
    states = recurrent and (recurrent.decode_rows.tolist(), recurrent.decode_slots.tolist(), recurrent.prefill)
    message = (STEP, h.shape[0], [(s.row, s.n, s.start, t, s.spans) for s, t in zip(seqs, tables)], states,
               logits_rows.tolist(), deepstack and (deepstack.rows.tolist(), deepstack.maps.shape[0]))
    for pipe in pipes:
        pipe.send(message)
    dist.broadcast(h.contiguous(), src=0)
    dist.broadcast(positions.contiguous(), src=0)
    if deepstack is not None:
        dist.broadcast(deepstack.maps.contiguous(), src=0)


def receive(pipe, hidden: int, dtype: torch.dtype, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, list[SeqRows], RecurrentRows | None, torch.Tensor,
                       DeepStack | None] | None:
    """A worker: the next step rank 0 sends (`send`), None when told to stop or rank 0 is gone."""
    try:
        command, rows, seqs, states, logits_rows, deepstack_rows = pipe.recv()
    except EOFError:
        return None
    if command == STOP:
        return None
    h = torch.empty((rows, hidden), dtype=dtype, device=device)
    positions = torch.empty((3, rows), dtype=torch.long, device=device)
    dist.broadcast(h, src=0)
    dist.broadcast(positions, src=0)
    deepstack = None
    if deepstack_rows:
        vision_rows, maps = deepstack_rows
        deepstack = DeepStack(torch.tensor(vision_rows, dtype=torch.long, device=device),
                              torch.empty((maps, len(vision_rows), hidden), dtype=dtype, device=device))
        dist.broadcast(deepstack.maps, src=0)
    recurrent = states and RecurrentRows(torch.tensor(states[0], dtype=torch.long, device=device),
                                         torch.tensor(states[1], dtype=torch.long, device=device), states[2])
    return (h, positions, [SeqRows(*seq) for seq in seqs], recurrent,
            torch.tensor(logits_rows, dtype=torch.long, device=device), deepstack)


def reset_states(seqs: list[SeqRows], recurrent: RecurrentRows, states) -> None:
    """A worker: the state slot of every sequence starting at token 0 zeroed, as rank 0's runner
    does (`ModelRunner.inputs`)."""
    slot_of = dict(zip(recurrent.decode_rows.tolist(), recurrent.decode_slots.tolist()))
    slot_of.update((row, slot) for row, _, slot in recurrent.prefill)
    for s in seqs:
        if s.start == 0:
            states.reset(slot_of[s.row])


# ---- the worker processes --------------------------------------------------------------------------
def worker_main(pipe, checkpoint: str, rank: int, world: int, port: int, device: str, dtype: str, num_blocks: int,
                block_size: int, max_batch: int) -> None:
    """A worker process: its shard of the model and of the KV cache, then every step rank 0 sends."""
    torch.set_grad_enabled(False)
    here = rank_device(torch.device(device), rank)
    pipe.send("joining")
    init_group(rank, world, port, here)
    try:
        model = DecoderModel.from_checkpoint(checkpoint, device=here, dtype=dtype, shard=Shard(rank, world))
        runner = ModelRunner(model, num_blocks, block_size, max_batch=max_batch)
        dist.barrier()  # loaded: rank 0's `Workers` waits for this
        hidden = model.config.hidden_size
        while (step := receive(pipe, hidden, model.dtype, here)) is not None:
            h, positions, seqs, recurrent, logits_rows, deepstack = step
            if recurrent is not None:
                reset_states(seqs, recurrent, runner.states)
            model.forward(StepBatch(h, positions, runner.attention.build(seqs), recurrent, logits_rows, deepstack),
                          runner.attention, runner.states)
    finally:
        dist.destroy_process_group()


class Workers:
    """Rank 0's side: the worker processes of a tensor-parallel group of `world` ranks, started
    here (spawned: no state of this process is inherited), each with a pipe for its steps, and
    the group joined as rank 0 once every worker is about to join (one that dies before is named
    at once instead of a rendezvous that waits out its timeout)."""

    def __init__(self, checkpoint: str | Path, world: int, device: torch.device, dtype: str, num_blocks: int,
                 block_size: int, max_batch: int) -> None:
        import multiprocessing

        self.device = device
        listener = loopback_listener()
        port = listener.getsockname()[1]
        context = multiprocessing.get_context("spawn")
        if os.environ.get(PYTHON_ENV):  # inside a Triton stub sys.executable is not Python
            context.set_executable(os.environ[PYTHON_ENV])
        self.pipes, self.processes = [], []
        for rank in range(1, world):
            here, there = context.Pipe()
            self.pipes.append(here)
            self.processes.append(context.Process(
                target=worker_main, name=f"llm-tp-rank{rank}", daemon=True,
                args=(there, str(checkpoint), rank, world, port, str(device), dtype, num_blocks, block_size, max_batch)))
        for process in self.processes:
            process.start()
        for pipe in self.pipes:
            while not pipe.poll(0.5):
                self.check()
            pipe.recv()
        with listener:
            init_group(0, world, port, device, listener)
        try:
            dist.barrier()  # every worker's shard loaded
        except RuntimeError as error:
            self.check()
            raise WorkerGone(f"llm tensor-parallel workers failed to start: {error}") from None

    def send(self, h: torch.Tensor, positions: torch.Tensor, seqs: list[SeqRows], recurrent: RecurrentRows | None,
             logits_rows: torch.Tensor, block_size: int, deepstack: DeepStack | None = None) -> None:
        """A step to every worker (`send`); WorkerGone if one has exited (or exits meanwhile)."""
        self.check()
        try:
            send(self.pipes, h, positions, seqs, recurrent, logits_rows, block_size, deepstack)
        except (RuntimeError, OSError):
            self.check()
            raise

    def check(self, wait: float = 0.0) -> None:
        """WorkerGone naming the first worker that exited; `wait`: seconds each worker may take to
        be seen exiting (after a failed collective, the peer that broke it may not be reaped yet)."""
        for rank, process in enumerate(self.processes, start=1):
            process.join(wait)
            if not process.is_alive():
                raise WorkerGone(f"llm tensor-parallel rank {rank} exited (code {process.exitcode})")

    def stop(self) -> None:
        """Tell the workers to stop, wait for them, leave the group."""
        for pipe in self.pipes:
            try:
                pipe.send((STOP, 0, [], []))
            except OSError:
                pass
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
        dist.destroy_process_group()
