"""LLaVA-OneVision's processor rules. LLaVA-OneVision (transformers `llava_onevision`,
`LlavaOnevisionForConditionalGeneration`): a SigLIP tower, LLaVA's projector (`tower`) and a Qwen2
decoder with 1-D RoPE.

Images as `LlavaOnevisionProcessor` sees them:

- one image in the prompt: a base view (the image resized to `size`) and the tiles of the best
  of `image_grid_pinpoints` for its size (`select_best_resolution`: the image resized into it
  keeping its aspect ratio, zero-padded to it, cut into `size` tiles); the model unpads the
  tiles' feature canvas back to the image's aspect ratio, cuts it to about N views' worth
  ("anyres_max_N", bilinear) and ends each of its rows with `image_newline`, after the base
  view's features;
- several images: each padded to a square of the mean colour, resized to `size`, one view, its
  features then one `image_newline`;
- videos: every frame resized to `size` (all frames, as the processor without `do_sample_frames`),
  each frame's features pooled 2 x 2 (bilinear, ceil(S / 2) a side), one `image_newline` after
  the frames.

Every item is one grid row [views, S, S] (`Family.pack_views`): an image's base view then its
tiles row-major, or a video's frames; S = `image_size / patch_size`. `<image>` / `<video>` expand
to the processor's counts (`image_tokens`, `video_tokens`), which `anyres_shape` gives the model's
way too (the tower uses it). Only the "full" feature strategy: transformers' model cannot place
"default"'s S * S - 1 features (it checks the base view's count).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from triton_vlm.errors import InvalidInput
from triton_vlm.families.base import MediaLayout
from triton_vlm.media.frames import View
from triton_vlm.media.mrope import MediaSpan
from triton_vlm.media.sizing import VisionSettings

IMAGE_TOKEN, VIDEO_TOKEN = "<image>", "<video>"
PAD, EOS, IM_START = "<|endoftext|>", "<|im_end|>", "<|im_start|>"


def best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """transformers' `select_best_resolution`: the (height, width) of `pinpoints` keeping most of
    the image's pixels once it is scaled into it, the least wasted among equals."""
    best, most, least = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < least):
            best, most, least = (h, w), effective, wasted
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """transformers' `get_patch_output_size`: the image scaled into `target`, aspect kept."""
    th, tw = target
    if tw / width < th / height:
        return min(math.ceil(height * (tw / width)), th), tw
    return th, min(math.ceil(width * (th / height)), tw)


def anyres_shape(height: int, width: int, side: int, tiles: tuple[int, int],
                 vision_aspect_ratio: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """((unpadded rows, columns), (rows, columns) after the anyres_max cut) of the feature canvas of
    `tiles` (rows, columns) tiles of `side` x `side` features, for an image of height x width:
    the processor's `_get_unpadded_features` and the model's `unpad_image`."""
    ch, cw = side * tiles[0], side * tiles[1]
    if width / height > cw / ch:
        ch -= (ch - int(round(height * (cw / width), 7))) // 2 * 2
    else:
        cw -= (cw - int(round(width * (ch / height), 7))) // 2 * 2
    max_views = int(vision_aspect_ratio.strip("anyres_max_"))
    ratio = math.sqrt(ch * cw / (max_views * side ** 2))
    return (ch, cw), ((int(ch // ratio), int(cw // ratio)) if ratio > 1.1 else (ch, cw))


def _side(settings: VisionSettings) -> int:
    """Features a side of one view: the processor's `num_image_tokens` (the image section holds the
    processor's own fields), else (the video section) the view's size in patches."""
    return math.isqrt(settings.num_image_tokens) or settings.resize_to[0] // settings.patch_size


def slice_rule(height: int, width: int, settings: VisionSettings, name: str) -> tuple[View, ...]:
    """The base view and the tiles' canvas (cut into tiles), or one square view (several images,
    video frames)."""
    if height <= 0 or width <= 0:
        raise InvalidInput(f"{name}: image has no pixels")
    size = settings.resize_to
    if not settings.image_grid_pinpoints:
        fill = tuple(int(m * 255) for m in settings.image_mean) if settings.pad_to_square else None
        return (View(size, fill=fill),)
    best = best_resolution(height, width, settings.image_grid_pinpoints)
    return (View(size), View(fitted_size(height, width, best), rows=best[0] // size[0], cols=best[1] // size[1],
                             crop=best))


def image_tokens(media: MediaLayout) -> int:
    """`LlavaOnevisionProcessor.replace_image_token`'s count."""
    settings, side = media.settings, _side(media.settings)
    if not settings.image_grid_pinpoints:
        return side * side + 1
    tiles = media.views[1]
    _, (fh, fw) = anyres_shape(*media.source, side, (tiles.rows, tiles.cols), settings.vision_aspect_ratio)
    return side * side + fh * fw + fh


def video_tokens(media: MediaLayout) -> int:
    """`LlavaOnevisionProcessor.replace_video_token`'s count."""
    return media.num_frames * math.ceil(_side(media.settings) / 2) ** 2 + 1


def expand_media(media: MediaLayout, token_id: Callable[[str], int],
                 encode: Callable[[list[str]], list[list[int]]]) -> tuple[np.ndarray, list[MediaSpan]]:
    """The placeholder repeated the processor's count; no spans: media tokens take text positions."""
    if media.settings.vision_feature_select_strategy != "full":
        raise ValueError("LLaVA-OneVision: only vision_feature_select_strategy 'full' is supported")
    n = video_tokens(media) if media.video else image_tokens(media)
    return np.full(n, media.token, dtype=np.int32), []


# `LlavaOnevisionConfig`'s and its image processor's pinpoints where a config gives none: 384 px
# tiles in grids of up to 6 x 6.
DEFAULT_PINPOINTS = tuple((384 * rows, 384 * cols) for rows in range(1, 7) for cols in range(1, 7))
