"""The `vision_encoder` front, free of Triton: a request's media items checked, split over the
instances of the batched model (`vision_encoder_batch`, reached through `send`), their embedding
rows joined back in prompt order and pruned (EVS).

The front holds no weights and imports no torch: it counts each item's embedding rows with the
tower's own numpy function (`Tower.ROWS`, named in its options), so that it can put the shares'
rows back in order. A tower whose frames are independent gets a video's frames as items of their
own, so that a long video splits across batches and instances and each frame is cached on its
own; a tower that packs frames gets each grid row whole. Every extra the tower takes goes with
every request to the batched model (its `none` where a request has nothing to say): requests with
the same inputs are the ones Triton's dynamic batcher may put in one execution.
"""
from __future__ import annotations

import importlib
import json
from typing import Callable

import numpy as np

from triton_vlm.contract.messages import EncoderBatchRequest, EncoderOutput, EncoderRequest, check_extras, check_media
from triton_vlm.contract.params import EncoderOptions
from triton_vlm.contract.tensors import EXTRA
from triton_vlm.errors import InvalidInput
from triton_vlm.media.evs import check_rate, prune
from triton_vlm.vision.batching import encode_in_shares


def _function(path: str) -> Callable:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class EncoderFront:
    """`encode(request)` for one `vision_encoder` request; `send(EncoderBatchRequest)` returns the
    batched model's embeddings of one share (raising InvalidInput for the request's own fault)."""

    def __init__(self, options: EncoderOptions, send: Callable[[EncoderBatchRequest], np.ndarray]) -> None:
        self.options, self.send = options, send
        self.settings = json.loads(options.tower_settings)  # parsed once, not per request
        self.rows = _function(options.rows)
        self.takes = tuple(name for name in options.extras.split(",") if name)

    def embedding_rows(self, grid: np.ndarray, extras: dict[str, np.ndarray]) -> np.ndarray:
        """Rows of each grid row, as the tower counts them (`Tower.ROWS`)."""
        return self.rows(grid, self.settings, extras)

    def encode(self, request: EncoderRequest) -> EncoderOutput:
        o = self.options
        pixels, items = check_media(request.pixel_values, request.grid_thw, o.patch_dim, o.spatial_merge_size)
        extras = check_extras(request.extras, items, self.takes)
        try:
            rate = check_rate(request.video_pruning_rate, "video_pruning_rate")
        except ValueError as error:
            raise InvalidInput(str(error)) from None
        grid = items
        if not o.packed_frames:  # each frame an item of its own (an item's values go with each frame)
            grid = np.repeat(np.concatenate([np.ones_like(items[:, :1]), items[:, 1:]], axis=1), items[:, 0], axis=0)
            extras = {name: value if EXTRA[name].per_frame else np.repeat(value, items[:, 0], axis=0)
                      for name, value in extras.items()}
        embeddings = encode_in_shares(
            pixels, grid, self.send, shares=o.batch_instances, max_rows=o.max_batch_patches, hidden=o.hidden,
            rows_per_item=self.embedding_rows(grid, extras),
            patch_extras={name: EXTRA[name].rows(extras.get(name), grid) for name in self.takes})
        embeddings, kept = prune(embeddings, items, o.spatial_merge_size, rate)
        return EncoderOutput(np.ascontiguousarray(embeddings, dtype=np.float32), kept)
