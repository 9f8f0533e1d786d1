"""Rotary position embeddings of the decoders: M-RoPE over three position axes (1-D RoPE is its
one-section case), the rotary dims paired as rotate-half (Qwen2) or interleaved (GLM-4)."""
from __future__ import annotations

import torch

from triton_vlm.llm.config import DecoderConfig
from triton_vlm.llm.layers import cuda_ops


class HalfPairs:
    """rotate_half (Qwen2): rotary dim i pairs with dim i +- r/2; both turn by frequency i mod r/2."""
    interleaved = False

    @staticmethod
    def partners(x: torch.Tensor) -> torch.Tensor:
        return x.roll(x.shape[-1] // 2, -1)

    @staticmethod
    def tables(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.arange(r)
        return torch.where(i < r // 2, -1.0, 1.0), i % (r // 2)


class InterleavedPairs:
    """rotate_half_llm (GLM-4): rotary dims (0, 1), (2, 3), ... pair up; pair j turns by frequency j."""
    interleaved = True

    @staticmethod
    def partners(x: torch.Tensor) -> torch.Tensor:
        return torch.stack((x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    @staticmethod
    def tables(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.arange(r)
        return torch.where(i % 2 == 0, -1.0, 1.0), i // 2


class Rotary:
    """M-RoPE over the first `rotary_dim` dims of each head (the rest pass through). A pairing
    (`HalfPairs`, `InterleavedPairs`) gives each rotary dim its partner's value (`partners`), the
    sign of the partner's term and the frequency that turns the pair (`tables`); `mrope_section`
    assigns the frequencies to the temporal / height / width position axes in turn. Dim i turns by
    `positions[axis[i]] * inv_freq[i]`, and `x * cos + partners(x) * sin` (sign folded into `sin`)
    is exactly transformers' `x * cos + rotate_half(x) * sin`. Interleaved M-RoPE (Qwen3.5's
    `recomposition_frequencies`): frequency j turns by the height axis if j % 3 == 1 and
    j < 3 * section[1], by the width axis if j % 3 == 2 and j < 3 * section[2], else by time.
    As in transformers, angles, cos and sin are float32 whatever the model's dtype; cos and sin are
    cast to `dtype` before they rotate q and k (in `dtype`). LongRoPE (`DecoderConfig.longrope`)
    divides each frequency by its factor and scales cos and sin."""

    def __init__(self, config: DecoderConfig, pairing: type, device: torch.device = torch.device("cpu"),
                 dtype: torch.dtype = torch.float32, theta: float | None = None, linear_factor: float = 1.0):
        """`theta`: the base (default the config's `rope_theta`); `linear_factor`: linear scaling, every
        frequency divided by it (transformers' "linear" rope type)."""
        r = self.rotary_dim = config.rotary_dim
        sign, freq = pairing.tables(r)
        section = config.mrope_section
        if config.mrope_interleaved:
            j = torch.arange(r // 2)
            axis_of_freq = torch.where((j % 3 == 1) & (j < 3 * section[1]), 1,
                                       torch.where((j % 3 == 2) & (j < 3 * section[2]), 2, 0))
        else:
            axis_of_freq = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
        base = (config.rope_theta if theta is None else theta) ** (torch.arange(0, r, 2, dtype=torch.float) / r)
        # LongRoPE: each frequency divided by its short factor (positions end before the long ones
        # apply, `DecoderConfig.from_checkpoint`), cos and sin scaled by the attention factor.
        longrope = config.longrope
        inv_freq = 1.0 / (base if longrope is None else torch.tensor(longrope.short_factor, dtype=torch.float) * base)
        if linear_factor != 1.0:
            inv_freq = inv_freq / linear_factor
        self.scale = 1.0 if longrope is None else longrope.attention_factor
        self.axis, self.inv_freq, self.sign = (t.to(device) for t in (axis_of_freq[freq], inv_freq[freq], sign))
        self.dtype = dtype
        self.partners, self.interleaved = pairing.partners, pairing.interleaved
        self.partial = r < config.head_dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, rotary_dim] in the model's dtype for 3-D positions [3, n] (on any device)."""
        angles = positions.to(self.axis.device)[self.axis].t().float() * self.inv_freq
        cos, sin = angles.cos(), angles.sin() * self.sign
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(self.dtype), sin.to(self.dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated; cos, sin [T, 1, rotary_dim]. On CUDA, one kernel (`cuda_ops`)."""
        if x.is_cuda:
            return cuda_ops.rotary(x, cos, sin, self.interleaved)
        return self.apply_torch(x, cos, sin)

    def apply_torch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply` in torch ops (the CPU path, and the reference of the CUDA kernel)."""
        if not self.partial:
            return x * cos + self.partners(x) * sin
        rot = x[..., :self.rotary_dim]
        return torch.cat([rot * cos + self.partners(rot) * sin, x[..., self.rotary_dim:]], dim=-1)
