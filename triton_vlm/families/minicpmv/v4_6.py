"""MiniCPM-V 4.6's processor rules (its tokens, frame sampling, prompt runs). MiniCPM-V 4.6
(transformers `minicpmv4_6`): a SigLIP-style vision tower with per-slice sizes,
a window-attention merger and a downsampling merger, on the Qwen3.5 hybrid text stack.

Images are sliced (the overview image plus a grid of slices under `max_slice_nums`); the prompt
holds one image token per image, which the processor replaces by
`<image_id>N</image_id><image>...</image>` and `<slice>...</slice>` runs, rows joined by newlines.

`preprocess` outputs (equal to `MiniCPMV4_6Processor`'s, mapped to the contract):

- `grid_thw`: one row `[1, h, w]` per image the tower encodes on its own, `h, w` its size in
  14 x 14 patches (transformers' `target_sizes` rows with a leading 1), prompt order. An image gives
  1 + rows * cols rows: the overview, then its slices row by row. A video gives that for every
  sampled frame in turn (frame 0's overview and slices, frame 1's, ...).
- `pixel_values`: float32 [N, 3 * 14 * 14], one row per patch; each grid row's h * w patches in
  raster order (patch (y, x) at row y * w + x), each row the patch's pixels in (channel, dy, dx)
  order, i.e. the Conv2d `patch_embedding` weight's (in, kh, kw) order. transformers packs the
  same values as [1, 3, 14, N * 14] (`reshape_by_patch`), patch k at columns 14k..14k+13: the tower
  gets that tensor back as `rows.reshape(N, 3, 14, 14).permute(1, 2, 0, 3).reshape(1, 3, 14, N * 14)`
  (or runs the Conv2d on `rows.reshape(N, 3, 14, 14)` directly) with `target_sizes = grid_thw[:, 1:]`.
- the vision_encoder's embeddings: one row per placeholder token, in prompt order; each grid row
  gives h * w / 16 (`downsample_mode` "16x") or h * w / 4 ("4x") tokens.
- `mrope_position_ids`: the plain positions 0..S-1 on all three axes, delta 0: the Qwen3.5 text
  model gets no position ids from `MiniCPMV4_6Model` and numbers the tokens in order.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from triton_vlm.errors import InvalidInput
from triton_vlm.families.base import MediaLayout
from triton_vlm.families.minicpmv.slicing import (IMAGE_END, IMAGE_ID_END, IMAGE_ID_START, IMAGE_START, SLICE_END,
                                                  SLICE_START, slice_runs)
from triton_vlm.media.mrope import MediaSpan
from triton_vlm.media.videos import distinct_indices, video_facts

IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, IMAGE_TOKEN, VIDEO_TOKEN, IMAGE_START, IMAGE_END,
                  SLICE_START, SLICE_END, IMAGE_ID_START, IMAGE_ID_END)


NAMED_TOKENS = {"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN, "image_start_token": IMAGE_START,
                "image_end_token": IMAGE_END, "slice_start_token": SLICE_START, "slice_end_token": SLICE_END,
                "image_id_start_token": IMAGE_ID_START, "image_id_end_token": IMAGE_ID_END}


def encoder_dims(config: dict) -> tuple[int, int]:
    vision = config["vision_config"]
    return vision.get("num_channels", 3) * vision["patch_size"] ** 2, config["text_config"]["hidden_size"]


def sample_frames(metadata, *, max_frames: int = 768, num_frames: int | None = None, max_num_frames: int = 128,
                  stack_frames: int = 1, **_other_options) -> np.ndarray:
    """`MiniCPMV4_6VideoProcessor.sample_frames`: one frame a second (the frame at the start of
    each second); a video longer than `max_num_frames` seconds gets `max_num_frames` frames spread
    over its length (on a 0.1 s grid). A request's `max_frames` lowers `max_num_frames`; its `fps`
    plays no part, as in transformers. Sub-second stacking (`stack_frames` > 1) is not supported."""
    if num_frames is not None:
        raise InvalidInput("num_frames: MiniCPM-V samples one frame a second, not by count; use max_frames")
    if stack_frames and int(stack_frames) > 1:
        raise ValueError("MiniCPM-V video: stack_frames > 1 is not supported")
    total, fps, duration = video_facts(metadata)
    limit = min(int(max_num_frames), int(max_frames))
    if duration > limit:
        stamps = np.round(np.arange(int(duration / 0.1)) * 0.1, 1)
        indices = np.minimum((stamps * fps).astype(np.int64), total - 1)
        if indices.size > limit:
            indices = indices[np.linspace(0, indices.size - 1, limit, dtype=int)]
    else:
        indices = (np.arange(math.ceil(duration)) * fps).astype(np.int64)
    return distinct_indices(indices)


def expand_media(media: MediaLayout, token_id: Callable[[str], int],
                 encode: Callable[[list[str]], list[list[int]]]) -> tuple[np.ndarray, list[MediaSpan]]:
    """The ids an image or video token becomes (`MiniCPMV4_6Processor.replace_image_token`,
    `replace_video_token`, `_prepend_local_ids`): see `slice_runs`, each run of the item's own
    token."""
    return slice_runs(media, media.token, token_id, encode)


