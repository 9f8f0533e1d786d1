"""The collectives of a tensor-parallel group (torch.distributed over gloo on the CPU, NCCL on
CUDA): joining it through rank 0's store, which listens on the loopback only (`init_group`), the
row-parallel layers' sum (`all_reduce`) and the LM head's vocabulary shards gathered on rank 0
(`gather_logits`). A leaf: the layers and the model call these, and nothing here knows them.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective waits this long for the other ranks; a dead peer fails it at once (its connection
# closes). Workers wait for the next step on their pipe, which has no timeout: an idle engine keeps
# its workers.
TIMEOUT = timedelta(seconds=600)


def loopback_listener() -> socket.socket:
    """Rank 0's rendezvous socket, listening on the loopback only: torch's TCPStore would listen on
    every interface, where any client on the network could reach the group's store."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the CPU, or the GPU r places after rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def init_group(rank: int, world: int, port: int, device: torch.device, listener: socket.socket | None = None) -> None:
    """Join the group through rank 0's store on 127.0.0.1:`port` (rank 0 serves it on `listener`;
    the store gets a descriptor of its own, which it closes when it stops)."""
    fd = None if listener is None else os.dup(listener.fileno())
    store = dist.TCPStore("127.0.0.1", port, world, is_master=listener is not None, timeout=TIMEOUT,
                          master_listen_fd=fd, use_libuv=False)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=TIMEOUT, device_id=device if device.type == "cuda" else None)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of a row-parallel layer's partial output, in place."""
    dist.all_reduce(x)
    return x


def gather_logits(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Rank 0: the whole vocabulary's logits [rows, vocab] from every rank's rows of it
    (`Shard.vocab_rows`, the last rank's padded to the others' width); other ranks: their own."""
    world = dist.get_world_size()
    per = -(-vocab // world)
    padded = torch.nn.functional.pad(logits, (0, per - logits.shape[1])) if logits.shape[1] < per else logits
    parts = [torch.empty_like(padded) for _ in range(world)] if dist.get_rank() == 0 else None
    dist.gather(padded.contiguous(), parts, dst=0)
    return torch.cat(parts, dim=1)[:, :vocab] if parts is not None else logits

