"""A request's inputs checked and put in the engine's form before anything is queued or taken
(vLLM's `InputProcessor`): every refusal is INVALID_ARG naming the input and the limit.

The prompt's token ids (in the vocabulary, inside the context and the KV cache pool with
`max_tokens`), the vision rows of its placeholder tokens, its M-RoPE positions ([3, n]; plain
`arange` on all axes for a text-only prompt) and decode delta, completed for EVS-pruned media, the
prefix-cache keys of its full blocks, and the compiled grammar of its guide, if it has one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from triton_vlm.errors import InvalidInput
from triton_vlm.llm.engine.block_manager import block_keys
from triton_vlm.llm.engine.grammar import Grammars
from triton_vlm.llm.engine.sampling import SamplingParams
from triton_vlm.llm.model import DecoderModel
from triton_vlm.media.mrope import complete_positions

if TYPE_CHECKING:
    import xgrammar


@dataclass(frozen=True)
class Prompt:
    """One request's checked inputs."""
    ids: torch.Tensor                    # [n] long
    positions: torch.Tensor              # [3, n] long
    delta: int                           # decode position = token index + delta
    embeddings: torch.Tensor | None      # placeholder rows, on the model's device in its dtype
    emb_index: torch.Tensor | None       # [n] long: each token's row of `embeddings`, or -1
    keys: list[bytes]                    # prefix-cache keys of full prompt blocks ([] without the cache)
    params: SamplingParams               # as this model applies them (`SamplingParams.for_model`)
    grammar: "xgrammar.CompiledGrammar | None" = None  # the guide's, where the request has one
    spans: tuple[tuple[int, int], ...] = ()  # bidirectional media runs (`media_spans`)


def as_tensor(value: Any, name: str, dtype: torch.dtype) -> torch.Tensor:
    """`value` as a host tensor of `dtype`, or INVALID_ARG naming it."""
    try:
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", dtype)
        return torch.as_tensor(np.asarray(value), dtype=dtype)
    except Exception:
        raise InvalidInput(f"{name}: not a numeric array") from None


def media_spans(mask: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The runs [a, b) of consecutive placeholder tokens of a prompt (`mask` [n] bool): each media
    block (an image, a pan-and-scan crop) that a `bidirectional_media` decoder attends both ways."""
    edges = torch.diff(torch.cat([mask.new_zeros(1), mask, mask.new_zeros(1)]).to(torch.int8)).nonzero()[:, 0]
    return tuple(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def completed_positions(pos: torch.Tensor, mask: torch.Tensor, media_position_ids: Any,
                        kept_rows: Any) -> tuple[torch.Tensor, int]:
    """`pos` with the media columns set from the unpruned media positions of the kept rows, and
    the delta that follows (InvalidInput when the shapes do not fit)."""
    media = as_tensor(media_position_ids, "media_position_ids", torch.long)
    if kept_rows is None:
        raise InvalidInput("kept_rows: required with media_position_ids")
    kept = as_tensor(kept_rows, "kept_rows", torch.long).reshape(-1)
    if media.ndim != 2 or media.shape[0] != 3:
        raise InvalidInput(f"media_position_ids: shape {list(media.shape)}, expected [3, media tokens]")
    if kept.numel() != int(mask.sum()):
        raise InvalidInput(f"kept_rows: {kept.numel()} rows for {int(mask.sum())} media placeholders")
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= media.shape[1]):
        raise InvalidInput(f"kept_rows: indices must be in [0, {media.shape[1]})")
    return complete_positions(pos, mask, media, kept)


class InputProcessor:
    """Checks requests for one model, its context (`context_length`) and KV cache pool
    (`pool_tokens`); `encode(word)` gives a stop or bad word's token ids, `grammars` compiles guides."""

    def __init__(self, model: DecoderModel, eos_token_ids: frozenset[int], encode: Callable[[str], list[int]],
                 context_length: int, pool_tokens: int, block_size: int, prefix_caching: bool,
                 grammars: Grammars) -> None:
        self.model, self.eos_token_ids, self.encode, self.grammars = model, eos_token_ids, encode, grammars
        self.context_length, self.pool_tokens = context_length, pool_tokens
        self.block_size, self.prefix_caching = block_size, prefix_caching

    def __call__(self, input_ids, embeddings, mrope_position_ids, mrope_position_delta, params: SamplingParams,
                 media_position_ids=None, kept_rows=None) -> Prompt:
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        vocab_size = self.model.config.vocab_size
        params = params.for_model(vocab_size, self.eos_token_ids, self.encode)
        if params.embedding_bias is not None:  # on the logits' device once, not at every step
            params.embedding_bias = torch.from_numpy(params.embedding_bias).to(self.model.device)
        ids = as_tensor(input_ids, "input_ids", torch.long).reshape(-1) if input_ids is not None else None
        if ids is None or ids.numel() == 0:
            raise InvalidInput("input_ids: empty prompt")
        n = int(ids.numel())
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise InvalidInput(f"input_ids: token ids must be in [0, {vocab_size}), "
                               f"got {int(ids.min())}..{int(ids.max())}")
        self._check_room(n, params.max_tokens)
        emb = None
        if embeddings is not None:
            emb = as_tensor(embeddings, "embeddings", torch.float32)
            if emb.ndim == 3 and emb.shape[0] == 1:  # a leading batch dimension of 1
                emb = emb[0]
        mask, emb = self.model.placeholder_rows(ids, emb)
        pos, delta = self._positions(n, mrope_position_ids, mrope_position_delta)
        if media_position_ids is not None and np.asarray(media_position_ids).size:
            pos, delta = completed_positions(pos, mask, media_position_ids, kept_rows)
        last_position = n + params.max_tokens - 1 + delta
        if last_position >= self.context_length:
            raise InvalidInput(f"prompt reaches position {last_position} with max_tokens "
                               f"{params.max_tokens}, context is {self.context_length}")
        emb_index = None
        if emb is not None:
            emb_index = torch.full((n,), -1, dtype=torch.long)
            emb_index[mask] = torch.arange(emb.shape[0])
        spans = media_spans(mask) if self.model.config.bidirectional_media else ()
        keys = block_keys(ids, pos, emb, mask, self.block_size, spans) if self.prefix_caching else []
        if emb is not None:  # keyed by the float32 rows above; cast once for the model
            emb = emb.to(self.model.device, self.model.dtype)
        grammar = None if params.guide_type is None else self.grammars.compile(params.guide_type, params.guide)
        return Prompt(ids, pos, delta, emb, emb_index, keys, params, grammar, spans)

    def _check_room(self, n: int, max_tokens: int) -> None:
        """The prompt and its answer fit the context and the KV cache pool."""
        if n + max_tokens > self.context_length:
            if n >= self.context_length:
                raise InvalidInput(f"prompt is {n} tokens, context is {self.context_length}")
            raise InvalidInput(f"prompt is {n} tokens and max_tokens is {max_tokens}, "
                               f"context is {self.context_length}")
        if n + max_tokens > self.pool_tokens:
            raise InvalidInput(f"prompt is {n} tokens and max_tokens is {max_tokens}, "
                               f"the KV cache pool holds {self.pool_tokens} tokens")

    @staticmethod
    def _positions(n: int, mrope_position_ids, mrope_position_delta) -> tuple[torch.Tensor, int]:
        """[3, n] positions and the decode delta as given, or those of a text-only prompt."""
        if mrope_position_ids is None:  # text only: 1-D positions on all axes
            pos = torch.arange(n).expand(3, n).clone()
        else:
            pos = as_tensor(mrope_position_ids, "mrope_position_ids", torch.long)
            if pos.ndim == 3 and pos.shape[1] == 1:
                pos = pos[:, 0]
            if tuple(pos.shape) != (3, n):
                raise InvalidInput(f"mrope_position_ids: shape {list(pos.shape)}, expected [3, {n}]")
        if mrope_position_delta is None:
            return pos, int(pos.max()) + 1 - n
        d = as_tensor(mrope_position_delta, "mrope_position_delta", torch.long).reshape(-1)
        if d.numel() != 1:
            raise InvalidInput(f"mrope_position_delta: shape {list(d.shape)}, expected [1]")
        return pos, int(d[0])
