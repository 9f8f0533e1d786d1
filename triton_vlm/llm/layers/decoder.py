"""The decoder layers: RMSNorm as transformers computes it, and the layer classes of the text
architectures several families' decoders use (Qwen2, Llama, Qwen3, the Qwen3.5 hybrid: their norms,
attention projections and MLP; the model applies the rotary and attends between `qkv` and
`finish`); a family's own layer classes subclass these in its folder's `decoder.py`. A layer
computes with its tensor-parallel rank's share (`triton_vlm.llm.distributed.sharding`), its
row-parallel outputs summed over the ranks by `reduce`."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from triton_vlm.llm.config import DecoderConfig
from triton_vlm.llm.distributed.collectives import all_reduce
from triton_vlm.llm.distributed.sharding import Shard
from triton_vlm.llm.layers import cuda_ops
from triton_vlm.llm.layers.linear_attention import GatedDeltaNet, RecurrentRows
from triton_vlm.llm.layers.moe import swiglu


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it in any dtype: the variance and the normalization in
    float32. A weight in x's dtype scales after the cast back (Qwen2RMSNorm, Glm4vRMSNorm: `weight *
    x.to(dtype)`); a float32 weight before it (Qwen3_5RMSNorm: `(x * (1 + weight.float())).to(dtype)`,
    see `SwiGLULayer.norm_weight`). In float32 both are the same. On CUDA, one kernel (`cuda_ops`)."""
    if x.is_cuda:
        return cuda_ops.rms_norm(x, weight, eps)
    return rms_torch(x, weight, eps)


def rms_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`_rms` in torch ops (the CPU path, and the reference of the CUDA kernel)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (normed * weight).to(x.dtype)
    return weight * normed.to(x.dtype)


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x


class SwiGLULayer:
    """What every decoder layer here shares: the input and post-attention RMSNorms (scaling by
    `norm_offset + weight`) and the SwiGLU MLP. Attention layers add `qkv` and `finish` (the model
    applies the rotary and attends between them); recurrent layers (`recurrent = True`) add
    `forward` over their per-sequence states instead."""
    norm_offset = 0.0
    recurrent = False

    def __init__(self, w: Callable[[str], torch.Tensor], config: DecoderConfig, shard: Shard = Shard()):
        """`config`: this rank's (`Shard.config`); `w` gives this rank's part of each weight."""
        self.c, self.shard = config, shard
        # a residual branch's row-parallel output (o_proj, down, the experts, the mixer) summed over
        # the ranks (unsplit: itself), and scaled where the decoder scales its branches
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _whole if shard.world == 1 else all_reduce
        if config.scaling.residual != 1.0:
            reduce, scale = self.reduce, config.scaling.residual
            self.reduce = lambda x: reduce(x) * scale
        self.ln1 = self.norm_weight(w("input_layernorm.weight"))
        self.ln2 = self.norm_weight(w("post_attention_layernorm.weight"))
        self.init_mlp(w)

    def init_mlp(self, w: Callable[[str], torch.Tensor]) -> None:
        # gate/up run as one matmul (weights concatenated once, at load)
        self.w_gate_up = self.gate_up_weight(w)
        self.w_down = w("mlp.down_proj.weight")

    @classmethod
    def norm_weight(cls, weight: torch.Tensor) -> torch.Tensor:
        """An RMSNorm's weight as `_rms` takes it. Offset norms (Qwen3.5's `1 + weight`) keep it in
        float32, as transformers adds the offset to the upcast weight and scales before casting
        back; plain ones keep it in the model's dtype, scaling after the cast."""
        return weight.float() + cls.norm_offset if cls.norm_offset else weight

    @staticmethod
    def gate_up_weight(w: Callable[[str], torch.Tensor]) -> torch.Tensor:
        return torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")])

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(swiglu(x, self.w_gate_up, self.w_down))

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        """The layer's second half: post-attention RMSNorm, MLP, residual add."""
        return h + self.mlp(_rms(h, self.ln2, self.c.rms_norm_eps))


class Qwen2Layer(SwiGLULayer):
    """One Qwen2 decoder layer: RMSNorm, GQA attention with q/k/v biases, SwiGLU MLP. Subclasses
    turn the biases off (`qkv_bias`) or have q_proj yield each head's output gate after its query
    (`q_gate`)."""
    qkv_bias = True
    q_gate = False

    def __init__(self, w: Callable[[str], torch.Tensor], config: DecoderConfig, shard: Shard = Shard()):
        super().__init__(w, config, shard)
        c = config
        # q/k/v run as one matmul
        self.w_qkv = torch.cat([w(f"self_attn.{p}_proj.weight") for p in "qkv"])
        self.b_qkv = torch.cat([w(f"self_attn.{p}_proj.bias") for p in "qkv"]) if self.qkv_bias else None
        self.wo = w("self_attn.o_proj.weight")
        kv = c.num_kv_heads * c.head_dim
        self._split = ((1 + self.q_gate) * c.num_heads * c.head_dim, kv, kv)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """h [T, hidden] -> q [T, heads, d] (with `q_gate`: [T, heads, 2d]), k, v [T, kv_heads, d]
        before the rotary, and the output gate `finish` takes (None: no gate)."""
        c, n = self.c, h.shape[0]
        x = _rms(h, self.ln1, c.rms_norm_eps)
        q, k, v = F.linear(x, self.w_qkv, self.b_qkv).split(self._split, dim=-1)
        return (q.view(n, c.num_heads, -1), k.view(n, c.num_kv_heads, c.head_dim),
                v.view(n, c.num_kv_heads, c.head_dim), None)

    def finish(self, h: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Residual of the attention output [T, heads * d], then the MLP block."""
        return self.mlp_block(h + self.reduce(F.linear(attn, self.wo)))


class LlamaLayer(Qwen2Layer):
    """A Llama decoder layer (`LlamaDecoderLayer` with `attention_bias` and `mlp_bias` false, their
    defaults; others are refused): Qwen2's without q/k/v biases."""
    qkv_bias = False


class Qwen3Layer(Qwen2Layer):
    """A Qwen3 decoder layer (`Qwen3DecoderLayer`): Qwen2's without q/k/v biases; q and k are
    RMS-normed per head before the rotary (`q_norm`, `k_norm`)."""
    qkv_bias = False

    def __init__(self, w: Callable[[str], torch.Tensor], config: DecoderConfig, shard: Shard = Shard()):
        super().__init__(w, config, shard)
        self.q_norm = self.norm_weight(w("self_attn.q_norm.weight"))
        self.k_norm = self.norm_weight(w("self_attn.k_norm.weight"))

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        d, eps = self.c.head_dim, self.c.rms_norm_eps
        q, k, v, _ = super().qkv(h)
        gate = q[..., d:].reshape(h.shape[0], -1) if self.q_gate else None
        return _rms(q[..., :d], self.q_norm, eps), _rms(k, self.k_norm, eps), v, gate


class Qwen35AttentionLayer(Qwen3Layer):
    """A Qwen3.5 full-attention layer (`Qwen3_5Attention`): Qwen3's, with q_proj yielding each
    head's query and its output gate side by side; the attention output is multiplied by
    sigmoid(gate) before o_proj. Norms scale by 1 + weight."""
    norm_offset = 1.0
    q_gate = True

    def finish(self, h: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return super().finish(h, attn * torch.sigmoid(gate), None)


class Qwen35LinearLayer(SwiGLULayer):
    """A Qwen3.5 linear-attention layer: the Gated DeltaNet token mixer over each sequence's
    recurrent state, then the MLP; norms scale by 1 + weight."""
    norm_offset = 1.0
    recurrent = True

    def __init__(self, w: Callable[[str], torch.Tensor], config: DecoderConfig, shard: Shard = Shard()):
        super().__init__(w, config, shard)
        self.mixer = GatedDeltaNet(w, config.linear_attention, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, rows: RecurrentRows, conv_state: torch.Tensor,
                recurrent_state: torch.Tensor) -> torch.Tensor:
        h = h + self.reduce(self.mixer(_rms(h, self.ln1, self.c.rms_norm_eps), rows, conv_state, recurrent_state))
        return self.mlp_block(h)
