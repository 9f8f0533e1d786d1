"""InternVL's processor rules (transformers `internvl`, `InternVLProcessor` with a
`GotOcr2ImageProcessor` and an `InternVLVideoProcessor`, torchvision backends).

Images: `InternVLProcessor` always crops to patches (its own `crop_to_patches=True` wins over a
saved false). Among every (columns, rows) with `min_patches` <= columns * rows <= `max_patches`
(sorted by their count) the grid whose aspect is closest to the image's is taken; on a tie the
later one wins while the image's area exceeds half the grid's tiles' area
(`get_optimal_tiled_canvas`). The image is resized to (rows * tile, columns * tile) (torchvision
BICUBIC, antialias, on uint8) and cut into tiles row-major; with more than one tile a thumbnail
(the whole image resized to the tile) follows. Videos: every frame resized to the video
processor's tile, one tile each (the video processor samples no frames by default: every frame
is taken).

Each tile and frame is a grid row [1, S, S] (S = tile / patch); `pixel_values` rows are patches
in raster order, each in the Conv2d weight's (channel, dy, dx) order. The tower gives S * S / 4
rows per tile (pixel shuffle 0.5). The prompt holds `<IMG_CONTEXT>` once per image and `<video>`
once per video: an image becomes `<img>` + `<IMG_CONTEXT>` x (its tiles' rows) + `</img>`, a video
`Frame1: <img>...</img>` lines joined by newlines. Positions are plain 0..S-1 (1-D RoPE).

The processor encodes the expanded prompt whole: "Frame1: " with the text before the video, each
later "\nFrameN: " between special tokens. So "Frame1: " goes into the text before `<video>`
(`Prompt.video_prefix`), and the expansion writes the later labels.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np

from triton_vlm.errors import InvalidInput
from triton_vlm.families.base import MediaLayout
from triton_vlm.media.frames import View
from triton_vlm.media.mrope import MediaSpan
from triton_vlm.media.sizing import VisionSettings

IMAGE_TOKEN, VIDEO_TOKEN = "<IMG_CONTEXT>", "<video>"
IMAGE_START, IMAGE_END = "<img>", "</img>"
PAD, EOS, IM_START = "<|endoftext|>", "<|im_end|>", "<|im_start|>"
FIRST_FRAME = "Frame1: "  # what the prompt's text holds before each video placeholder


def encoder_dims(config: dict) -> tuple[int, int]:
    """(patch row width, embedding width): channels * patch^2 pixels, the text model's hidden size."""
    from triton_vlm.vision.tower.config import square

    vision = config["vision_config"]
    patch = square(vision.get("patch_size", 14), "patch_size")
    return vision.get("num_channels", 3) * patch ** 2, config["text_config"]["hidden_size"]


@lru_cache(maxsize=64)
def tile_grid(height: int, width: int, tile: tuple[int, int], min_patches: int, max_patches: int) -> tuple[int, int]:
    """`get_optimal_tiled_canvas`: (columns, rows) of the tiles an image of height x width is cut into."""
    grids = sorted(((c, r) for c in range(1, max_patches + 1) for r in range(1, max_patches + 1)
                    if min_patches <= c * r <= max_patches), key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for columns, rows in grids:
        diff = abs(aspect - columns / rows)
        if diff < best_diff:
            best, best_diff = (columns, rows), diff
        elif diff == best_diff and area > 0.5 * tile[0] * tile[1] * columns * rows:
            best = (columns, rows)
    return best


def slice_rule(height: int, width: int, settings: VisionSettings, name: str) -> tuple[View, ...]:
    """The tiles' canvas (cut into tiles), then the thumbnail where there is more than one tile."""
    if settings.do_sample_frames:  # (the preprocess model's warm-up meets this first: the model does not load)
        raise ValueError("InternVL: the video processor's do_sample_frames is not supported (every frame is taken)")
    if height <= 0 or width <= 0:
        raise InvalidInput(f"{name}: image has no pixels")
    tile = settings.resize_to
    if not all(tile):
        raise ValueError("InternVL: the image processor config has no size.height and size.width")
    if not 1 <= settings.min_patches <= settings.max_patches:
        raise ValueError(f"InternVL: min_patches {settings.min_patches} and max_patches {settings.max_patches} "
                         "allow no tiling")
    columns, rows = tile_grid(height, width, tile, settings.min_patches, settings.max_patches)
    canvas = View((rows * tile[0], columns * tile[1]), rows=rows, cols=columns)
    return (canvas,) if rows * columns == 1 else (canvas, View(tile))


def _tile_tokens(media: MediaLayout) -> list[int]:
    """Rows the tower gives each of the item's grid rows (2 x 2 patches each, the pixel shuffle)."""
    return [t * (h // 2) * (w // 2) for t, h, w in media.grids]


def expand_media(media: MediaLayout, token_id: Callable[[str], int],
                 encode: Callable[[list[str]], list[list[int]]]) -> tuple[np.ndarray, list[MediaSpan]]:
    """`InternVLProcessor`'s expansion; no spans: media tokens take text positions."""
    start, end = token_id(IMAGE_START), token_id(IMAGE_END)
    context = token_id(IMAGE_TOKEN)
    tokens = _tile_tokens(media)
    if not media.video:
        return np.array([start] + [context] * sum(tokens) + [end], dtype=np.int32), []
    labels = [[]] + encode([f"\nFrame{i + 1}: " for i in range(1, len(tokens))])  # (Frame1's is the prompt's)
    ids: list[int] = []
    for label, n in zip(labels, tokens):
        ids += [*label, start, *[context] * n, end]
    return np.array(ids, dtype=np.int32), []
