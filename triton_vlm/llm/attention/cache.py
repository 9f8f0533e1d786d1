"""The tensors of the paged KV cache and of the recurrent states, owned by the model runner.

K and V of every attention layer live in `KVCache.k` / `.v` [layers, blocks * block_size, kv_heads,
head_dim]; a token's slot is `block * block_size + offset` (`triton_vlm.llm.engine.block_manager` says
which blocks belong to which sequence). `StateCache` holds the linear-attention layers' recurrent
state, one slot per running sequence.
"""
from __future__ import annotations

import torch

from triton_vlm.llm.layers.linear_attention import STATE_DTYPE


def token_slots(blocks: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Slot of every token 0 .. num_tokens-1 of a sequence with this block table (host tensor)."""
    table = torch.tensor(blocks[:-(-num_tokens // block_size)], dtype=torch.long)
    return (table[:, None] * block_size + torch.arange(block_size)[None, :]).reshape(-1)[:num_tokens]


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        shape = (num_layers, self.num_blocks * self.block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> "KVCache":
        """K/V for the config's attention layers only."""
        return cls(len(config.kv_layers), config.num_kv_heads, config.head_dim, num_blocks, block_size, dtype, device)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class StateCache:
    """The recurrent state of the linear-attention layers, one slot per running sequence:
    `conv` [layers, slots, conv_dim, conv_kernel - 1] (the causal conv's last inputs) and
    `recurrent` [layers, slots, v_heads, k_head_dim, v_head_dim] (the delta-rule state). Slots come
    from the block manager (lowest free first); the tensors grow (doubling, up to `max_slots`) to
    hold the highest slot in use. `reset` zeroes a slot when a sequence starts at token 0.
    `conv` is in the model's dtype (`dtype`), `recurrent` in float32 whatever it is, as transformers
    keeps them (`triton_vlm.llm.layers.linear_attention.STATE_DTYPE`)."""

    def __init__(self, num_layers: int, max_slots: int, conv_shape: tuple[int, ...],
                 recurrent_shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.max_slots = max(1, int(max_slots))
        self.conv = torch.zeros((num_layers, 0, *conv_shape), dtype=dtype, device=device)
        self.recurrent = torch.zeros((num_layers, 0, *recurrent_shape), dtype=STATE_DTYPE, device=device)

    @classmethod
    def for_model(cls, config, max_slots: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> "StateCache":
        lin = config.linear_attention
        return cls(len(config.layer_types) - len(config.kv_layers), max_slots, lin.conv_state_shape,
                   lin.recurrent_state_shape, dtype, device)

    @property
    def capacity(self) -> int:
        return self.conv.shape[1]

    def ensure(self, slot: int) -> None:
        """Room for `slot` (grown by doubling; existing slots keep their values)."""
        old = self.capacity
        if slot < old:
            return
        if slot >= self.max_slots:
            raise RuntimeError(f"state slot {slot} is beyond the {self.max_slots} slots")
        new = min(self.max_slots, max(slot + 1, 2 * old))
        grown = [t.new_zeros((t.shape[0], new, *t.shape[2:])) for t in (self.conv, self.recurrent)]
        grown[0][:, :old], grown[1][:, :old] = self.conv, self.recurrent
        self.conv, self.recurrent = grown

    def reset(self, slot: int) -> None:
        self.ensure(slot)
        self.conv[:, slot] = 0
        self.recurrent[:, slot] = 0
