"""What every MiniCPM-V version shares in its processor: slicing an image into an overview and a
grid of slices (`slice_rule`, ports of `MiniCPMV4_6ImageProcessor`'s size rules, the same from 2.6
on), and the prompt runs a picture becomes (`slice_runs`: `<image_id>`, `<image>` and `<slice>`
runs, slice rows joined by newlines, a grid's slices in one `<slice>` or each in its own).
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

# The markers around a picture's runs, the same in every version's tokenizer.
IMAGE_START, IMAGE_END = "<image>", "</image>"
SLICE_START, SLICE_END = "<slice>", "</slice>"
IMAGE_ID_START, IMAGE_ID_END = "<image_id>", "</image_id>"


# ------------------------------------------------------------------------------------- slicing
# Ports of `MiniCPMV4_6ImageProcessor`'s (and the identical video processor's) size rules.

MAX_ASPECT_RATIO = 200


def _ensure_divide(length: float, divisor: int) -> int:
    return max(round(length / divisor) * divisor, divisor)


def _merge_factor(settings: VisionSettings) -> int:
    """Patches per side one LLM token covers: "4x" merges 2 x 2 patches, "16x" 4 x 4; a resampler
    merges none (slice sides are whole patches)."""
    return {"4x": 2, "16x": 4, "resampler": 1}[settings.downsample_mode]


def _run_tokens(settings: VisionSettings, h: int, w: int) -> int:
    """Placeholder tokens of one view of h x w patches."""
    if settings.downsample_mode == "resampler":
        return settings.image_feature_size
    return h * w // _merge_factor(settings) ** 2


def best_resize(height: float, width: float, settings: VisionSettings, allow_upscale: bool,
                resolution: int | None = None) -> tuple[int, int]:
    """`find_best_resize`: about `resolution`^2 pixels (default `scale_resolution`) at the same
    aspect ratio (only shrinking unless `allow_upscale`), sides multiples of patch_size * merge factor."""
    scale = resolution or settings.scale_resolution
    if height * width > scale * scale or allow_upscale:
        aspect_ratio = width / height
        height = int(scale / math.sqrt(aspect_ratio))
        width = int(height * aspect_ratio)
    divisor = settings.patch_size * _merge_factor(settings)
    return _ensure_divide(height, divisor), _ensure_divide(width, divisor)


def _sliced_grid(height: int, width: int, settings: VisionSettings) -> tuple[int, int] | None:
    """`get_sliced_grid`: (rows, cols) of slices, None for an image small enough to stay whole."""
    log_ratio = math.log(width / height)
    ratio = width * height / (settings.scale_resolution ** 2)
    multiple = min(math.ceil(ratio), settings.max_slice_nums)
    if multiple <= 1:
        return None
    best, min_error = (1, 1), float("inf")
    for num_slices in (multiple - 1, multiple, multiple + 1):
        if num_slices == 1 or num_slices > settings.max_slice_nums:
            continue
        for rows in range(1, num_slices + 1):
            if num_slices % rows == 0:
                error = abs(log_ratio - math.log((num_slices // rows) / rows))
                if error < min_error or (error == min_error and rows > best[0]):
                    best, min_error = (rows, num_slices // rows), error
    return best


def slice_rule(height: int, width: int, settings: VisionSettings, name: str) -> tuple[View, ...]:
    """An image's (or video frame's) views: the overview at `find_best_resize`'s size, then (when
    `slice_mode` and the image is larger than one slice) the whole image resized to
    `get_refine_size` and cut into the `get_sliced_grid` slices. An aspect ratio over 200 raises
    `InvalidInput`."""
    if height <= 0 or width <= 0:
        raise InvalidInput(f"{name}: image has no pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidInput(f"{name}: aspect ratio {max(height, width) / min(height, width):.1f} "
                           f"exceeds max_aspect_ratio={MAX_ASPECT_RATIO}")
    grid = _sliced_grid(height, width, settings) if settings.slice_mode else None
    # MiniCPM-OCR's `small_image_upsize` "never" (and "adaptive", until `refine_layout` looks at
    # the pixels) keeps a small unsliced image's size.
    overview = View(best_resize(height, width, settings,
                                allow_upscale=grid is None and settings.small_image_upsize == "always"))
    if grid is None:
        return (overview,)
    rows, cols = grid
    slice_h, slice_w = best_resize(_ensure_divide(height, rows) / rows, _ensure_divide(width, cols) / cols,
                                    settings, allow_upscale=True)
    return overview, View((slice_h * rows, slice_w * cols), rows, cols)


# ---------------------------------------------------------------------------------- the prompt


def slice_runs(media: MediaLayout, fill: int, token_id: Callable[[str], int],
               encode: Callable[[list[str]], list[list[int]]]) -> tuple[np.ndarray, list[MediaSpan]]:
    """`<image_id>N</image_id>` (N the item's index among its kind; with `use_image_id`), then per
    frame `<image>` + the overview's run of `fill` tokens + `</image>` and its slices' runs, slice
    rows joined by a newline: each slice as `<slice>` + run + `</slice>` (MiniCPM-V's processors,
    2.6 to 4.6), or with `grid_in_one_slice` (2.0, 2.5) as `<image>` + run + `</image>`, the grid
    between one `<slice>` and `</slice>`. No spans: media tokens take text positions (the model's
    positions are plain 0..S-1)."""
    start, end = token_id(IMAGE_START), token_id(IMAGE_END)
    slice_start, slice_end = token_id(SLICE_START), token_id(SLICE_END)
    one_slice = media.settings.grid_in_one_slice
    cell_start, cell_end = (start, end) if one_slice else (slice_start, slice_end)
    grid_start, grid_end = ([slice_start], [slice_end]) if one_slice else ([], [])
    index_ids, newline = encode([str(media.index), "\n"])
    runs = iter([_run_tokens(media.settings, h, w) for _, h, w in media.grids])
    ids: list[int] = [token_id(IMAGE_ID_START), *index_ids, token_id(IMAGE_ID_END)] if media.settings.use_image_id else []
    sliced = media.views[1:]
    for _ in range(media.num_frames):
        ids += [start, *[fill] * next(runs), end]
        for view in sliced:
            ids += grid_start
            for r in range(view.rows):
                if r:
                    ids += newline
                for _ in range(view.cols):
                    ids += [cell_start, *[fill] * next(runs), cell_end]
            ids += grid_end
    return np.asarray(ids, dtype=np.int32), []
