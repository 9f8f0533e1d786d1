"""The SigLIP / CLIP encoder layer the towers share (parameter names as in the Hugging Face
state_dicts: `self_attn.{q,k,v,out}_proj`, `mlp.fc1/fc2`, `layer_norm1/2`): attention with biases
and no rotary, q, k and v from one MatMul, over host-given groups (`forward`) or runs of adjacent
rows (`windows`)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from triton_vlm.vision.tower import layers as tower_layers


class SiglipAttention(nn.Module):
    """q / k / v / out projections with biases, no rotary; q, k and v from one MatMul."""

    fused = True  # see tower_layers.VisionAttention

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        return nn.functional.linear(x, weight, bias)

    def forward(self, x, index, mask, inverse, lengths):
        """Attention inside the groups of `index` / `mask` / `inverse` (see `attention_groups.groups`)."""
        dim = x.shape[1]
        groups, length = index.shape
        q, k, v = self._qkv(x).index_select(0, index.reshape(-1)).reshape(groups, length, 3, dim).unbind(2)
        out = tower_layers.attention(q, k, v, mask, lengths, self.num_heads, self.fused)
        return self.out_proj(out.reshape(groups * length, dim).index_select(0, inverse))

    def windows(self, x: torch.Tensor, size: int) -> torch.Tensor:
        """Attention inside each run of `size` adjacent rows."""
        n, dim = x.shape
        q, k, v = self._qkv(x).reshape(n // size, size, 3, dim).unbind(2)
        return self.out_proj(tower_layers.attention(q, k, v, None, None, self.num_heads, self.fused).reshape(n, dim))


class SiglipMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = tower_layers.activation(act)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    """LayerNorm, attention, residual; LayerNorm, MLP, residual."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.layer_norm1, self.layer_norm2 = tower_layers.LayerNorm(dim, eps=eps), tower_layers.LayerNorm(dim, eps=eps)
        self.self_attn = SiglipAttention(dim, cfg["num_heads"])
        self.mlp = SiglipMLP(dim, cfg["intermediate_size"], cfg["hidden_act"])

    def forward(self, x, index, mask, inverse, lengths):
        x = x + self.self_attn(self.layer_norm1(x), index, mask, inverse, lengths)
        return x + self.mlp(self.layer_norm2(x))

