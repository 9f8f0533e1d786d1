"""MiniCPM-V's resampler (the official `resampler.py`): learned queries attending over each group's
tower rows, keys carrying a 2-D sin-cos of their patch's (row, column); every group gives
`query_num` rows. 2.6's and 4.0's `Resampler` resample each slice on its own (2.0's,
`Resampler2_0`, with the stored query sin-cos added to its queries); 4.5's
(`Resampler4_5`) also adds to a video frame's keys a 1-D sin-cos of its temporal id, a group being
the frames packed together."""
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
    """`Resampler`: keys and values from the tower's rows (`kv_proj`, an identity where the tower
    is as wide as the LLM; `ln_kv`), keys plus their 2-D sin-cos (column half first), the learned
    queries (`ln_q`) attending over each group's keys, `ln_post`, `proj`. `key_positions`: each
    row's (row, column, temporal id or -1)."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim, q = cfg["out_hidden_size"], cfg["query_num"]
        self.num_heads = dim // 128
        self.query = nn.Parameter(torch.zeros(q, dim))
        self.kv_proj = nn.Linear(cfg["hidden_size"], dim, bias=False) if cfg["hidden_size"] != dim else nn.Identity()
        self.attn = nn.MultiheadAttention(dim, self.num_heads)
        self.ln_q, self.ln_kv, self.ln_post = (tower_layers.LayerNorm(dim, eps=LAYER_NORM_EPS) for _ in range(3))
        self.proj = nn.Parameter(torch.zeros(dim, dim))

    def key_sincos(self, key_positions: torch.Tensor) -> torch.Tensor:
        half = self.query.shape[1] // 2
        return torch.cat([sincos(key_positions[:, 1], half), sincos(key_positions[:, 0], half)], dim=-1)

    def queries(self) -> torch.Tensor:
        """The attention's query inputs, float32 [query_num, dim]."""
        return self.ln_q(self.query).float()

    def forward(self, x, key_positions, group_index, group_mask):
        dim = self.query.shape[1]
        x = self.ln_kv(self.kv_proj(x)).float()
        w, b = self.attn.in_proj_weight.float(), self.attn.in_proj_bias.float()
        q = nn.functional.linear(self.queries(), w[:dim], b[:dim])
        k = nn.functional.linear(x + self.key_sincos(key_positions), w[dim:2 * dim], b[dim:2 * dim])
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


class Resampler2_0(Resampler):
    """2.0's: the queries also carry the query grid's 2-D sin-cos, a table the checkpoint stores
    (`pos_embed`)."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg)
        self.pos_embed = nn.Parameter(torch.zeros_like(self.query))

    def queries(self) -> torch.Tensor:
        return super().queries() + self.pos_embed.float()


class Resampler4_5(Resampler):
    """`Resampler4_5`: a video frame's keys (temporal id >= 0) also carry its temporal sin-cos."""

    def key_sincos(self, key_positions: torch.Tensor) -> torch.Tensor:
        temporal = key_positions[:, 2]
        pos = super().key_sincos(key_positions)
        return pos + sincos(temporal.clamp(min=0), self.query.shape[1]) * (temporal >= 0).float()[:, None]
