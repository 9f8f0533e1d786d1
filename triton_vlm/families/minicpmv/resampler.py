"""MiniCPM-V's resampler (the official `resampler.py`, 4.5's `Resampler4_5` with temporal ids): its
learned queries attend over each group's tower rows, keys carrying a 2-D sin-cos of their patch's
(row, column) and, for a video frame, a 1-D sin-cos of its temporal id; every group gives
`query_num` rows."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from triton_vlm.vision.tower import layers as tower_layers

LAYER_NORM_EPS = 1e-6  # the resampler's LayerNorms (`partial(nn.LayerNorm, eps=1e-6)`), and SigLIP's


def sincos(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """[len(pos), dim]: sin then cos of pos * 10000^(-2i / dim) (`get_1d_sincos_pos_embed_from_grid`)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float32, device=pos.device) / (dim / 2.0))
    angles = pos.float()[:, None] * omega[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


class Resampler(nn.Module):
    """`Resampler4_5`: keys and values from the tower's rows (`kv_proj`, `ln_kv`; keys plus their
    2-D sin-cos, column half first, and a frame's temporal sin-cos), the learned queries (`ln_q`)
    attending over each group's keys, `ln_post`, `proj`."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim, q = cfg["out_hidden_size"], cfg["query_num"]
        self.num_heads = dim // 128
        self.query = nn.Parameter(torch.zeros(q, dim))
        self.kv_proj = nn.Linear(cfg["hidden_size"], dim, bias=False)
        self.attn = nn.MultiheadAttention(dim, self.num_heads)
        self.ln_q, self.ln_kv, self.ln_post = (tower_layers.LayerNorm(dim, eps=LAYER_NORM_EPS) for _ in range(3))
        self.proj = nn.Parameter(torch.zeros(dim, dim))

    def forward(self, x, key_positions, group_index, group_mask):
        dim = self.query.shape[1]
        x = self.ln_kv(self.kv_proj(x)).float()
        pos = torch.cat([sincos(key_positions[:, 1], dim // 2), sincos(key_positions[:, 0], dim // 2)], dim=-1)
        temporal = key_positions[:, 2]
        pos = pos + sincos(temporal.clamp(min=0), dim) * (temporal >= 0).float()[:, None]
        w, b = self.attn.in_proj_weight.float(), self.attn.in_proj_bias.float()
        q = nn.functional.linear(self.ln_q(self.query).float(), w[:dim], b[:dim])
        k = nn.functional.linear(x + pos, w[dim:2 * dim], b[dim:2 * dim])
        v = nn.functional.linear(x, w[2 * dim:], b[2 * dim:])
        groups, length = group_index.shape
        flat = group_index.reshape(-1)
        heads, head_dim = self.num_heads, dim // self.num_heads
        k = k.index_select(0, flat).reshape(groups, length, heads, head_dim).transpose(1, 2)
        v = v.index_select(0, flat).reshape(groups, length, heads, head_dim).transpose(1, 2)
        q = q.reshape(1, -1, heads, head_dim).transpose(1, 2) * head_dim ** -0.5
        scores = torch.matmul(q, k.transpose(2, 3)) + group_mask.float()[:, None, None, :]
        out = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(-1, dim)
        out = nn.functional.linear(out, self.attn.out_proj.weight.float(), self.attn.out_proj.bias.float())
        return self.ln_post(out.to(self.proj.dtype)) @ self.proj

