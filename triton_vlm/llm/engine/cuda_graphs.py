"""CUDA graphs of the decode step, as TensorRT-LLM and vLLM capture them.

A decode step is a few hundred small kernels (per layer: norms, q/k/v, rotary, the K/V write,
attention, o_proj, the MLP); launched one by one from Python, the launches take longer than the GPU
does. `DecodeGraphs` captures the whole step (embedding lookup to float32 logits) once per batch
size bucket, at start-up, and a step of B decoding sequences replays the smallest bucket >= B: one
launch. The graph reads its inputs from fixed device buffers (token ids, 3-D positions, K/V slots,
block tables, context lengths), which each step fills with one host-to-device copy per buffer from
pinned memory; rows past B are padding that attends to, and writes, a scratch block of its own (the
KV pool's last block, never given to a sequence). Steps with a prefill chunk run eagerly.

Only decoders whose step has no data-dependent control flow are captured: not the mixture-of-
experts layers (their loop runs over the experts a step's rows chose) nor linear attention (its
state slots); those run eagerly (`DecoderModel.capturable`).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from triton_vlm.llm.attention.base import AttentionMetadata, PagedDecode
from triton_vlm.llm.attention.cuda import TritonAttention
from triton_vlm.llm.engine.scheduler import ScheduledChunk
from triton_vlm.llm.model import DecoderModel, StepBatch

log = logging.getLogger(__name__)

# batch sizes captured (vLLM's steps: every 8 up to 64, then every 16, 32), up to the engine's max_running
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def bucket_sizes(max_batch: int) -> list[int]:
    return sorted({b for b in BUCKETS if b < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model: DecoderModel, attention: TritonAttention, max_batch: int, max_blocks: int,
                 scratch_block: int):
        self.model, self.attention = model, attention
        self.block_size = attention.kv.block_size
        self.scratch_block = scratch_block
        self.sizes = bucket_sizes(max_batch)
        n, device = self.sizes[-1], model.device
        # the inputs of every captured step: pinned host buffers, and their device copies the graphs read
        self.host = dict(ids=torch.zeros(n, dtype=torch.long), positions=torch.zeros(n, 3, dtype=torch.long),
                         slots=torch.full((n,), scratch_block * self.block_size, dtype=torch.long),
                         tables=torch.full((n, max_blocks), scratch_block, dtype=torch.int32),
                         lens=torch.ones(n, dtype=torch.int32))
        self.host = {k: v.pin_memory() for k, v in self.host.items()}
        self.np = {k: v.numpy() for k, v in self.host.items()}
        self.inputs = {k: v.to(device) for k, v in self.host.items()}
        self.rows = torch.arange(n, device=device)
        self.copied = torch.cuda.Event()  # recorded after a step's copies: its pinned buffers may be refilled
        self.num_replays = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            self._step(b)  # warm-up outside the capture: Triton compiles, cuBLAS chooses its kernels
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._step(b)
            self.graphs[b] = graph
        log.info("llm decode: CUDA graphs captured for batch sizes %s", self.sizes)

    def _step(self, b: int) -> torch.Tensor:
        x = self.inputs
        h = F.embedding(x["ids"][:b], self.model.embed_tokens)
        meta = AttentionMetadata(x["slots"][:b], [], PagedDecode(None, x["tables"][:b], x["lens"][:b]))
        return self.model.forward(StepBatch(h, x["positions"][:b].t(), meta, None, self.rows[:b]), self.attention, None)

    def takes(self, chunks: list[ScheduledChunk]) -> bool:
        """A step of generated tokens only (no prompt row), each sampling, at most the largest bucket."""
        return 0 < len(chunks) <= self.sizes[-1] and all(c.is_decode for c in chunks)

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """float32 logits [len(chunks), vocab] of a step that `takes`."""
        B = len(chunks)
        b = next(s for s in self.sizes if s >= B)
        bs, host = self.block_size, self.np
        self.copied.synchronize()
        for i, c in enumerate(chunks):
            seq, t = c.seq, c.start
            host["ids"][i] = seq.tokens[t]
            host["positions"][i] = t + seq.delta
            host["slots"][i] = seq.blocks[t // bs] * bs + t % bs
            used = seq.blocks[:t // bs + 1]
            host["tables"][i, :len(used)] = used
            host["lens"][i] = t + 1
        # padding rows: their own scratch slot, a context of one token
        host["ids"][B:b] = 0
        host["positions"][B:b] = 0
        host["slots"][B:b] = self.scratch_block * bs
        host["tables"][B:b, 0] = self.scratch_block
        host["lens"][B:b] = 1
        for name, device_buffer in self.inputs.items():
            device_buffer[:b].copy_(self.host[name][:b], non_blocking=True)
        self.copied.record()
        self.graphs[b].replay()
        self.num_replays += 1
        return self.logits[b][:B].clone()


