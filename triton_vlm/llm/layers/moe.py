"""Mixture-of-experts MLPs: transformers' `Glm4vMoeTextMoE` (a sigmoid router with a
score-correction bias and group-limited top-k, routed SwiGLU experts and always-on shared experts)
and Qwen3-VL-MoE's `Qwen3VLMoeTextSparseMoeBlock` (a softmax router whose top-k weights are
renormalised to sum 1, routed experts only: `SoftmaxMoe`).

Numerics follow transformers in any dtype: router logits, scores and routing weights in float32
(the correction bias is a float32 buffer whatever the model's dtype); each expert's output is
multiplied by its float32 routing weight (Qwen3-VL-MoE's: cast to the model's dtype first, as its
router returns them), cast back to the model's dtype and summed with `index_add_` in ascending
expert order, as transformers' eager experts do.
Experts run batched over a step's rows: the rows are grouped by expert and each expert that some
row chose runs one matmul over all of its rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MoeConfig:
    """The MoE settings of a text config (`Glm4vMoeTextConfig`'s field names; Qwen3-MoE's
    `num_experts`, `decoder_sparse_step` and `mlp_only_layers` read into them)."""
    num_experts: int             # n_routed_experts
    num_experts_per_tok: int     # top-k experts per token
    n_group: int                 # expert groups; each token keeps the best `topk_group` of them
    topk_group: int
    norm_topk_prob: bool         # divide the chosen weights by their sum
    routed_scaling_factor: float
    moe_intermediate_size: int   # of each routed expert; the shared experts' is n_shared_experts times it
    n_shared_experts: int
    first_k_dense_replace: int   # layers before this index keep a dense MLP
    decoder_sparse_step: int = 1  # of the others, every n-th layer is sparse ((i + 1) % n == 0) ...
    mlp_only_layers: tuple[int, ...] = ()  # ... but these, which keep a dense MLP

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts."""
        return (layer >= self.first_k_dense_replace and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_text_config(cls, text: dict[str, Any]) -> "MoeConfig | None":
        """The MoE settings of a text config; None for a dense model (no `n_routed_experts`, nor
        Qwen3-MoE's `num_experts` / `num_local_experts`: no groups, no shared experts, sparse layers
        by `decoder_sparse_step` and `mlp_only_layers`)."""
        if not text.get("n_routed_experts"):
            # transformers 5 saves Qwen3-MoE's `num_experts` as `num_local_experts` (its attribute map)
            experts = text.get("num_local_experts") or text.get("num_experts")
            if not experts:
                return None
            c = cls(num_experts=int(experts), num_experts_per_tok=int(text["num_experts_per_tok"]),
                    n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                    moe_intermediate_size=int(text["moe_intermediate_size"]), n_shared_experts=0,
                    first_k_dense_replace=0, decoder_sparse_step=int(text.get("decoder_sparse_step") or 1),
                    mlp_only_layers=tuple(int(i) for i in text.get("mlp_only_layers") or ()))
            if not 1 <= c.num_experts_per_tok <= c.num_experts:
                raise ValueError(f"config.json: {c.num_experts_per_tok} experts per token of {c.num_experts}")
            return c
        c = cls(num_experts=int(text["n_routed_experts"]), num_experts_per_tok=int(text["num_experts_per_tok"]),
                n_group=int(text.get("n_group", 1)), topk_group=int(text.get("topk_group", 1)),
                norm_topk_prob=bool(text.get("norm_topk_prob", True)),
                routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
                moe_intermediate_size=int(text["moe_intermediate_size"]),
                n_shared_experts=int(text.get("n_shared_experts", 1)),
                first_k_dense_replace=int(text.get("first_k_dense_replace", 1)))
        per_group = c.num_experts // c.n_group
        if c.num_experts % c.n_group or per_group < 2 or not 1 <= c.topk_group <= c.n_group \
                or not 1 <= c.num_experts_per_tok <= c.topk_group * per_group:
            raise ValueError(f"config.json: {c.num_experts} experts in {c.n_group} groups, top-{c.topk_group} "
                             f"groups, {c.num_experts_per_tok} experts per token")
        return c


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, c: MoeConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`Glm4vMoeTextTopkRouter`: x [T, hidden] -> (routing weights [T, k] float32, expert ids [T, k]).
    Sigmoid scores of float32 logits; the choice ranks scores + `bias`: groups by the sum of their
    top-2, the best `topk_group` groups kept, then the top k experts among them; the weights are the
    chosen experts' unbiased scores (normalised to sum 1 with `norm_topk_prob`), times
    `routed_scaling_factor`."""
    scores = F.linear(x.float(), weight.float()).sigmoid()
    choice = scores + bias
    n = x.shape[0]
    group_scores = choice.view(n, c.n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
    groups = group_scores.topk(c.topk_group, dim=-1, sorted=False).indices
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~kept.repeat_interleave(c.num_experts // c.n_group, dim=1), float("-inf"))
    ids = choice.topk(c.num_experts_per_tok, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * c.routed_scaling_factor, ids


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)), gate and up as one matmul (`w_gate_up` = [gate; up])."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def run_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, experts: range) -> torch.Tensor:
    """The routed experts' sum for each row of x [T, hidden] (`Glm4vMoeTextExperts`, eager):
    ids, weights [T, k]; gate_up [E', 2I, hidden], down [E', hidden, I] the weights of `experts`
    (all of them, or a tensor-parallel rank's: the sum is then over those only). Rows grouped by
    expert, one matmul pair per expert that some row chose; each expert's output times its float32
    weight, cast to x's dtype, added into its rows in ascending expert order."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = order // k
    row_weights = weights.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=experts.stop).tolist()  # one device sync
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count and e in experts:
            r = rows[start:start + count]
            local = e - experts.start
            y = swiglu(x.index_select(0, r), gate_up[local], down[local])
            out.index_add_(0, r, (y * row_weights[start:start + count, None]).to(out.dtype))
        start += count
    return out


def expert_weights(w: Callable[[str], torch.Tensor], experts: range) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, hidden] and down [E, hidden, I] of `mlp.experts` (of `experts`: all, or a
    tensor-parallel rank's, whose loader gives those only): transformers 5's fused parameters
    (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) where the checkpoint has them, else
    stacked from the per-expert layout that `save_pretrained` writes and the released checkpoints
    hold (`mlp.experts.{e}.{gate,up,down}_proj.weight`)."""
    try:
        return w("mlp.experts.gate_up_proj"), w("mlp.experts.down_proj")
    except KeyError:
        pass
    gate_up = torch.stack([torch.cat([w(f"mlp.experts.{e}.gate_proj.weight"), w(f"mlp.experts.{e}.up_proj.weight")])
                           for e in experts])
    down = torch.stack([w(f"mlp.experts.{e}.down_proj.weight") for e in experts])
    return gate_up, down


class SparseMoe:
    """`Glm4vMoeTextMoE` of one layer, from its `mlp.*` weights: routed experts plus shared experts."""

    def __init__(self, w: Callable[[str], torch.Tensor], config: MoeConfig, experts: range):
        """`experts`: the routed experts whose weights `w` gives (all; a tensor-parallel rank's)."""
        self.c, self.experts = config, experts
        self.router = w("mlp.gate.weight")                          # [E, hidden], model dtype
        self.bias = w("mlp.gate.e_score_correction_bias").float()   # [E], float32 (the loader keeps it so)
        self.gate_up, self.down = expert_weights(w, experts)
        self.shared_gate_up = torch.cat([w("mlp.shared_experts.gate_proj.weight"),
                                         w("mlp.shared_experts.up_proj.weight")])
        self.shared_down = w("mlp.shared_experts.down_proj.weight")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.router, self.bias, self.c)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (post-attention-normed rows) -> routed experts + shared experts [T, hidden]."""
        weights, ids = self.route(x)
        return (run_experts(x, ids, weights, self.gate_up, self.down, self.experts)
                + swiglu(x, self.shared_gate_up, self.shared_down))


def softmax_route(x: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`Qwen3VLMoeTextTopKRouter`: x [T, hidden] -> (routing weights [T, k] in x's dtype, expert ids
    [T, k]): softmax of the logits in float32, top k, renormalised to sum 1 (always: the class
    has no flag), cast back to the logits' dtype."""
    logits = F.linear(x, weight)
    top, ids = torch.softmax(logits, dim=-1, dtype=torch.float).topk(k, dim=-1)
    return (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype), ids


class SoftmaxMoe:
    """`Qwen3VLMoeTextSparseMoeBlock` of one layer: the softmax router (`mlp.gate.weight`) and the
    routed experts; no shared expert."""

    def __init__(self, w: Callable[[str], torch.Tensor], config: MoeConfig, experts: range):
        self.c, self.experts = config, experts
        self.router = w("mlp.gate.weight")
        self.gate_up, self.down = expert_weights(w, experts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_route(x, self.router, self.c.num_experts_per_tok)
        return run_experts(x, ids, weights, self.gate_up, self.down, self.experts)
