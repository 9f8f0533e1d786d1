"""The model runner: owns the KV cache and recurrent-state tensors on the model's device, turns a
step's scheduled chunks into one `StepBatch` (input embeddings with the vision rows in place,
positions, attention metadata built once), runs the forward pass and samples the next tokens."""
from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from triton_vlm.errors import InvalidInput
from triton_vlm.llm.attention.base import AttentionBackend, SeqRows, TorchAttention
from triton_vlm.llm.attention.cache import KVCache, StateCache
from triton_vlm.llm.engine.grammar import bitmask
from triton_vlm.llm.engine.sampling import sample_batch, token_logprobs
from triton_vlm.llm.engine.scheduler import ScheduledChunk
from triton_vlm.llm.engine.sequence import Sequence
from triton_vlm.llm.engine.streaming import IncrementalDetokenizer, TokenLogprobs
from triton_vlm.llm.layers.linear_attention import RecurrentRows
from triton_vlm.llm.model import DecoderModel, DeepStack, StepBatch

log = logging.getLogger(__name__)


class OtherRanks(Protocol):
    """The other ranks of a tensor-parallel model (`tensor_parallel.Workers`): each step goes to
    them before it runs here."""

    def send(self, h: torch.Tensor, positions: torch.Tensor, seqs: list[SeqRows], recurrent: RecurrentRows | None,
             logits_rows: torch.Tensor, block_size: int, deepstack: DeepStack | None) -> None: ...


class ModelRunner:
    """`max_batch` sequences at most in one step. On CUDA, decode attention reads the paged cache in
    place (`TritonAttention`; prompt chunks too with `paged_prefill`: `PagedPrefillAttention`) and, with `cuda_graphs` and a capturable decoder, decode steps of up to
    `max_batch` sequences of up to `max_context` tokens replay CUDA graphs (`DecodeGraphs`; the KV
    pool then has one more block, the graphs' scratch block)."""

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, max_batch: int = 1,
                 cuda_graphs: bool = False, max_context: int = 0, paged_prefill: bool = False,
                 workers: OtherRanks | None = None):
        """`workers`: the other ranks of a tensor-parallel model (`triton_vlm.llm.engine.tensor_parallel`),
        each step sent to them before it runs here (no CUDA graphs then)."""
        self.model = model
        self.workers = workers
        cuda_graphs = cuda_graphs and workers is None
        c = model.config
        weight = model.embed_tokens
        self.device, self.dtype = weight.device, weight.dtype
        cuda = self.device.type == "cuda"
        graphs = cuda and cuda_graphs and model.capturable
        self.kv = KVCache.for_model(c, num_blocks + graphs, block_size, self.dtype, self.device)
        self.states = StateCache.for_model(c, max_batch, self.dtype, self.device) if c.recurrent else None
        self.graphs = None
        if cuda:
            from triton_vlm.llm.attention.cuda import TritonAttention
            from triton_vlm.llm.attention.paged_prefill import PagedPrefillAttention

            torch.cuda.set_device(self.device)
            # cuDNN's SDPA builds an execution plan for every new prefill shape (on an H100: first
            # steps of 0.1 to 1 s), and prompt lengths are always new; flash attention needs none
            torch.backends.cuda.enable_cudnn_sdp(False)
            self.attention: AttentionBackend = (PagedPrefillAttention if paged_prefill else TritonAttention)(c, self.kv)
        else:
            self.attention = TorchAttention(c, self.kv)
        if graphs:
            from triton_vlm.llm.engine.cuda_graphs import DecodeGraphs

            max_blocks = -(-min(max_context or num_blocks * block_size, num_blocks * block_size) // block_size)
            self.graphs = DecodeGraphs(model, self.attention, max_batch, max_blocks, scratch_block=num_blocks)
        elif cuda_graphs and cuda:
            log.info("llm decode: no CUDA graphs for %s (mixture of experts or linear attention)", c.family)

    def prepare(self, chunks: list[ScheduledChunk]) -> StepBatch:
        h, positions, seq_rows, recurrent, logits_rows, deepstack = self.inputs(chunks)
        return StepBatch(h, positions, self.attention.build(seq_rows), recurrent, logits_rows, deepstack)

    def inputs(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, list[SeqRows],
                                                             RecurrentRows | None, torch.Tensor, DeepStack | None]:
        """A step's input rows [T, hidden] (token embeddings, vision rows in place), positions [3, T],
        each sequence's rows, the linear-attention rows, the rows that sample, and the DeepStack
        maps of its vision rows (those of the prompt chunks it runs: a chunk served from the prefix
        cache or run in an earlier step had its maps added there)."""
        T = sum(c.num_tokens for c in chunks)
        ids: list[int] = []
        positions = torch.empty(3, T, dtype=torch.long)
        seq_rows, logits_rows, vision = [], [], []
        decode_rows, decode_slots, prefill = [], [], []
        row = 0
        for c in chunks:
            seq, n, a, e = c.seq, c.seq.prompt_len, c.start, c.end
            ids.extend(seq.tokens[a:e])
            if a < n:
                positions[:, row:row + min(e, n) - a] = seq.positions[:, a:min(e, n)]
                if seq.emb_index is not None:
                    idx = seq.emb_index[a:min(e, n)]
                    hit = idx >= 0
                    if bool(hit.any()):
                        vision.append((row + hit.nonzero()[:, 0], seq.embeddings[idx[hit]]))
            if e > n:
                first = max(a, n)
                positions[:, row + first - a:row + c.num_tokens] = torch.arange(first, e) + seq.delta
            seq_rows.append(SeqRows(row, c.num_tokens, a, seq.blocks, seq.spans if a < n else ()))
            if self.states is not None:
                if seq.state is None:
                    raise ValueError("a decoder with linear-attention layers needs a state slot per sequence")
                if a == 0:
                    self.states.reset(seq.state)
                if c.num_tokens == 1:
                    decode_rows.append(row)
                    decode_slots.append(seq.state)
                else:
                    prefill.append((row, c.num_tokens, seq.state))
            if c.samples:
                logits_rows.append(row + c.num_tokens - 1)
            row += c.num_tokens
        h = F.embedding(torch.tensor(ids, dtype=torch.long).to(self.device), self.model.embed_tokens)
        hidden, maps = self.model.config.hidden_size, self.model.config.deepstack_maps
        for rows, emb in vision:
            h[rows.to(self.device)] = emb[:, :hidden].to(self.device, h.dtype)
        deepstack = None
        if vision and maps:
            rows = torch.cat([r for r, _ in vision]).to(self.device)
            stacked = torch.cat([e[:, hidden:] for _, e in vision]).to(self.device, h.dtype)
            deepstack = DeepStack(rows, stacked.view(-1, maps, hidden).transpose(0, 1).contiguous())
        recurrent = None
        if self.states is not None:
            recurrent = RecurrentRows(torch.tensor(decode_rows, dtype=torch.long).to(self.device),
                                      torch.tensor(decode_slots, dtype=torch.long).to(self.device), prefill)
        logits_rows = torch.tensor(logits_rows, dtype=torch.long).to(self.device)
        return h, positions.to(self.device), seq_rows, recurrent, logits_rows, deepstack

    def forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """float32 logits [chunks that sample, vocab], on the model's device."""
        if self.graphs is not None and self.graphs.takes(chunks):
            return self.graphs.run(chunks)
        if self.workers is None:
            return self.model.forward(self.prepare(chunks), self.attention, self.states)
        h, positions, seq_rows, recurrent, logits_rows, deepstack = self.inputs(chunks)
        self.workers.send(h, positions, seq_rows, recurrent, logits_rows, self.kv.block_size, deepstack)
        return self.model.forward(StepBatch(h, positions, self.attention.build(seq_rows), recurrent, logits_rows,
                                            deepstack), self.attention, self.states)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The next token of each sequence from its row of `logits` (`NO_TOKEN` for a row whose
        logits are not finite): one batched draw on the device, one host copy (and, with guided
        rows, one copy of their bitmask to the device); and its log-probabilities
        (`token_logprobs`: the token's, and the top alternatives the request asks for) where it
        asks, else None."""
        context = [torch.tensor(s.tokens) if s.params.reads_context else None for s in seqs]
        tokens = sample_batch(logits, [s.params for s in seqs], [s.generator for s in seqs], context,
                              [s.num_generated for s in seqs], bitmask([s.grammar for s in seqs], logits.shape[1]))
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        rows = [i for i, s in enumerate(seqs) if s.params.return_log_probs or s.params.num_top_log_probs]
        if rows:
            top = max(seqs[i].params.num_top_log_probs for i in rows)
            chosen, values, ids = (t.tolist() for t in token_logprobs(logits, tokens, rows, top))
            for j, i in enumerate(rows):
                k = seqs[i].params.num_top_log_probs
                logprobs[i] = TokenLogprobs(chosen[j], ids[j][:k], values[j][:k])
        return tokens.tolist(), logprobs


def prompt_logits(model: DecoderModel, input_ids: torch.Tensor, embeddings: torch.Tensor | None,
                  positions: torch.Tensor) -> torch.Tensor:
    """The last prompt position's float32 logits [vocab] through a scratch runner (tests, tools)."""
    from triton_vlm.llm.engine.block_manager import BlockManager
    from triton_vlm.llm.engine.inputs import media_spans
    from triton_vlm.llm.engine.sampling import SamplingParams

    ids = input_ids.reshape(-1).long()
    n = ids.numel()
    positions = torch.as_tensor(positions).long().reshape(3, -1)
    if positions.shape[1] != n:
        raise InvalidInput(f"mrope_position_ids: shape [3, {positions.shape[1]}], expected [3, {n}]")
    mask, emb = model.placeholder_rows(ids, embeddings)
    emb_index = None
    if emb is not None:
        emb_index = torch.full((n,), -1, dtype=torch.long)
        emb_index[mask] = torch.arange(emb.shape[0])
    blocks = BlockManager(-(-n // 16), 16, state_slots=1)
    seq = Sequence("prompt", n, ids.tolist(), emb, emb_index, positions, 0, SamplingParams(max_tokens=1),
                   emit=lambda out: None, is_cancelled=lambda: False, generator=torch.Generator(),
                   detok=IncrementalDetokenizer(None, []), blocks=blocks.allocate(blocks.num_blocks),
                   state=blocks.allocate_state(), spans=media_spans(mask) if model.config.bidirectional_media else ())
    runner = ModelRunner(model, blocks.num_blocks, blocks.block_size)
    return runner.forward([ScheduledChunk.of(seq, n)])[0]
