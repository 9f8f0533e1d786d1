"""Tensor parallelism's split of the decoder's weights (issue #31): which part of each checkpoint
tensor rank r of N holds, and the per-rank config the layers then compute with.

Megatron's split, as vLLM and nano-vllm do it:
- attention: the query heads split evenly (column-parallel q/k/v, row-parallel o_proj); the KV
  heads too where there are at least N of them, else each rank keeps the one KV head its query
  heads read (replicated across N / KV ranks, as vLLM does);
- MLP: gate/up column-parallel, down row-parallel (a fused `gate_up_proj` split per half);
- mixture of experts: the routed experts split by expert (each rank runs the experts it
  holds on the rows routed to them; every rank routes every row, the router replicated), the shared
  experts by width. By expert rather than by width: an expert's matmuls stay whole (they are
  1408 wide in a 106B model: 176 a rank at 8 ranks), and a rank reads only its experts' weights;
- the embedding replicated, the LM head split by vocabulary rows and the logits gathered on rank 0,
  which samples: a vocabulary-parallel embedding would need an all-reduce of every step's input
  rows for a table of 1 to 2.5 GB at these vocabularies, a gathered head one gather of the rows
  that sample;
- linear attention (Gated DeltaNet) by head: each rank its key heads and the value
  heads that read them (in_proj_qkv and the conv's channels per part, z, b, a, A_log, dt_bias),
  out_proj row-parallel; each rank keeps its heads' conv and delta-rule states;
- norms, rotary and the router replicated.
Row-parallel outputs (o_proj, down, the MoE, out_proj) are partial sums, all-reduced by the layer
(`SwiGLULayer.reduce`).

`plan(name, shape)` says which slices of a checkpoint tensor a rank reads (the safetensors reader
reads only those: no rank holds a full copy of a split tensor).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

Slices = tuple[slice, ...]

_Q = re.compile(r"self_attn\.q_proj\.(weight|bias)$")
_KV = re.compile(r"self_attn\.[kv]_proj\.(weight|bias)$")
_O = re.compile(r"self_attn\.o_proj\.weight$")
_COLUMN = re.compile(r"mlp\.(shared_experts?\.)?(gate|up)_proj\.weight$")
_FUSED = re.compile(r"mlp\.gate_up_proj\.weight$")
_ROW = re.compile(r"mlp\.(shared_experts?\.)?down_proj\.weight$")
_EXPERTS = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)$")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.")
_HEAD = re.compile(r"(^|\.)lm_head\.weight$")
_LINEAR_MIXED = re.compile(r"linear_attn\.(in_proj_qkv|conv1d)\.weight$")
_LINEAR_HEADS = re.compile(r"linear_attn\.(in_proj_[zba]\.weight|A_log|dt_bias)$")
_LINEAR_OUT = re.compile(r"linear_attn\.out_proj\.weight$")


def _part(total: int, rank: int, world: int, what: str) -> slice:
    if total % world:
        raise ValueError(f"tensor parallel {world}: {total} {what} do not split evenly")
    n = total // world
    return slice(rank * n, (rank + 1) * n)


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of a tensor-parallel group of `world` ranks (1: the whole model)."""
    rank: int = 0
    world: int = 1

    def check(self, config) -> None:
        """ValueError naming what does not split (`config`: the whole model's `DecoderConfig`)."""
        if self.world == 1:
            return
        if (lin := config.linear_attention) is not None:
            _part(lin.num_k_heads, 0, self.world, "linear-attention key heads")
            _part(lin.num_v_heads, 0, self.world, "linear-attention value heads")
        kv, world = config.num_kv_heads, self.world
        _part(config.num_heads, 0, world, "attention heads")
        if kv % world and world % kv:
            raise ValueError(f"tensor parallel {world}: {kv} KV heads neither split evenly nor replicate evenly")
        _part(config.intermediate_size, 0, world, "MLP columns")
        if config.moe is not None:
            _part(config.moe.num_experts, 0, world, "routed experts")
            _part(config.moe.moe_intermediate_size * config.moe.n_shared_experts, 0, world, "shared-expert columns")

    def kv_heads(self, num_kv_heads: int) -> slice:
        """The KV heads this rank keeps."""
        if num_kv_heads >= self.world:
            return _part(num_kv_heads, self.rank, self.world, "KV heads")
        head = self.rank * num_kv_heads // self.world
        return slice(head, head + 1)

    def experts(self, num_experts: int) -> range:
        part = _part(num_experts, self.rank, self.world, "routed experts")
        return range(part.start, part.stop)

    def vocab_rows(self, vocab: int) -> slice:
        """This rank's rows of the LM head: `ceil(vocab / world)` each, the last rank's fewer."""
        per = -(-vocab // self.world)
        return slice(min(vocab, self.rank * per), min(vocab, (self.rank + 1) * per))

    def config(self, config):
        """The per-rank `DecoderConfig` the layers compute with: this rank's heads and MLP columns
        (the vocabulary, the hidden size and the routing over every expert stay whole; which
        experts a rank holds is `experts`)."""
        if self.world == 1:
            return config
        self.check(config)
        kv = self.kv_heads(config.num_kv_heads)
        lin = config.linear_attention and dataclasses.replace(
            config.linear_attention, num_k_heads=config.linear_attention.num_k_heads // self.world,
            num_v_heads=config.linear_attention.num_v_heads // self.world)
        return dataclasses.replace(config, num_heads=config.num_heads // self.world, num_kv_heads=kv.stop - kv.start,
                                   intermediate_size=config.intermediate_size // self.world, linear_attention=lin)

    def plan(self, name: str, shape: tuple[int, ...], config) -> list[Slices] | None:
        """The slices of checkpoint tensor `name` (of `shape`) this rank reads, concatenated along
        dim 0; None: all of it. `config`: the whole model's `DecoderConfig`. A per-expert tensor
        of an expert this rank does not hold is `[]`: not read."""
        if self.world == 1:
            return None
        r, n = self.rank, self.world
        if _Q.search(name):
            return [(_part(shape[0], r, n, "query rows"),)]
        if _KV.search(name):
            per_head = shape[0] // config.num_kv_heads
            kv = self.kv_heads(config.num_kv_heads)
            return [(slice(kv.start * per_head, kv.stop * per_head),)]
        if _O.search(name):
            return [(slice(None), _part(shape[1], r, n, "o_proj columns"))]
        if _COLUMN.search(name):
            return [(_part(shape[0], r, n, "MLP rows"),)]
        if _FUSED.search(name):
            half = shape[0] // 2
            part = _part(half, r, n, "MLP rows")
            return [(part,), (slice(half + part.start, half + part.stop),)]
        if _ROW.search(name):
            return [(slice(None), _part(shape[1], r, n, "MLP columns"))]
        if _EXPERTS.search(name):
            experts = self.experts(shape[0])
            return [(slice(experts.start, experts.stop),)]
        if expert := _EXPERT.search(name):
            return None if int(expert[1]) in self.experts(config.moe.num_experts) else []
        if _HEAD.search(name):
            return [(self.vocab_rows(shape[0]),)]
        if _LINEAR_MIXED.search(name):  # channels: the keys' q, their k, the values' v
            lin = config.linear_attention
            parts = (lin.key_dim, lin.key_dim, lin.value_dim)
            starts = (0, lin.key_dim, 2 * lin.key_dim)
            return [(slice(start + mine.start, start + mine.stop),)
                    for start, size in zip(starts, parts) for mine in (_part(size, r, n, "linear-attention channels"),)]
        if _LINEAR_HEADS.search(name):
            return [(_part(shape[0], r, n, "linear-attention value heads"),)]
        if _LINEAR_OUT.search(name):
            return [(slice(None), _part(shape[1], r, n, "linear-attention value columns"))]
        return None
