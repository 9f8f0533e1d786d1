"""MiniCPM-OCR (transformers `minicpm_ocr`): MiniCPM-V 4.6's model for documents. The tower, merger
and Qwen3.5 decoder are 4.6's (the config defaults to `downsample_mode` "4x", 2 x 2 patches a
token, and ties the word embeddings); prompts and positions are 4.6's.

What its image processor (`MiniCPMOcrImageProcessor`) adds is `small_image_upsize`: an unsliced
image, or a slice whose region of the original image is no larger than `scale_resolution`^2, is
upscaled to `scale_resolution` ("always", 4.6's rule), kept at its native size ("never") or sized
by its glyphs ("adaptive", `glyph_resolution`): Otsu binarisation and 8-connected components
(OpenCV, as transformers runs it) give the glyph heights and density; small dense text is read at
`scale_resolution`, a tiny image at 84 pixels, anything else at its own size. An adaptive slice
only ever costs fewer tokens than the plain slice it replaces, and is cut from the original image
(`_tile`), so slices of one image may differ in size: each is its own grid row.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from triton_vlm.errors import InvalidInput
from triton_vlm.families import minicpmv
from triton_vlm.imaging import FrameLayout, View, VisionSettings

# The glyph classifier's calibration (transformers' constants of the same names)
SMALL_FONT_PX = 12.0
DENSE_GLYPHS_PER_KPX = 2.0
TINY_PIXELS = 6272
TINY_RESOLUTION = 84


def glyph_resolution(image: np.ndarray, scale_resolution: int, name: str) -> int | None:
    """`adaptive_upsize_resolution` of uint8 RGB pixels [H, W, 3]: `scale_resolution` for small
    dense text, TINY_RESOLUTION for a tiny image, None to keep the native size."""
    import cv2

    height, width = image.shape[:2]
    if height <= 0 or width <= 0:
        return None
    rgb = image.astype(np.int32)  # ITU-R 601-2 luma, PIL's convert("L") integer arithmetic
    gray = ((rgb[..., 0] * 19595 + rgb[..., 1] * 38470 + rgb[..., 2] * 7471 + 32768) >> 16).astype(np.uint8)
    try:
        _, binarized = cv2.threshold(gray, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
        foreground = binarized == 0
        if foreground.mean() > 0.5:  # light text on a dark page
            foreground = ~foreground
        _, _, stats, _ = cv2.connectedComponentsWithStats(foreground.astype(np.uint8), connectivity=8)
    except cv2.error as error:
        raise InvalidInput(f"{name}: the document analysis (OpenCV) cannot read this image: "
                           f"{str(error).strip().splitlines()[-1]}") from None
    widths, heights, areas = stats[1:, cv2.CC_STAT_WIDTH], stats[1:, cv2.CC_STAT_HEIGHT], stats[1:, cv2.CC_STAT_AREA]
    glyphs = heights[(areas >= 3) & (heights >= 2) & (widths < 0.9 * width) & (heights < 0.9 * height)]
    font_px = float(np.median(glyphs)) if glyphs.size else 0.0
    density = glyphs.size * 1000.0 / (width * height)
    if 0 < font_px <= SMALL_FONT_PX and density >= DENSE_GLYPHS_PER_KPX:
        return scale_resolution
    if height * width < TINY_PIXELS:
        return TINY_RESOLUTION
    return None


def _tile(image: np.ndarray, refine: View, row: int, col: int, settings: VisionSettings, name: str) -> View | None:
    """`_resolve_tile_size`: the cell (row, col) of the original image at its adaptive size, where
    that costs fewer tokens than the refined image's slice; None keeps the slice."""
    height, width = image.shape[:2]
    top, bottom = round(height * row / refine.rows), round(height * (row + 1) / refine.rows)
    left, right = round(width * col / refine.cols), round(width * (col + 1) / refine.cols)
    cell_h, cell_w = bottom - top, right - left
    scale = settings.scale_resolution
    if cell_h < 1 or cell_w < 1 or cell_h * cell_w > scale ** 2:
        return None
    resolution = glyph_resolution(image[top:bottom, left:right], scale, name)
    if resolution == scale:
        return None
    size = minicpmv.best_resize(cell_h, cell_w, settings, allow_upscale=resolution is not None, resolution=resolution)
    if size[0] * size[1] >= refine.slice_size[0] * refine.slice_size[1]:
        return None
    return View(size, region=(top, bottom, left, right))


def refine_layout(layout: FrameLayout, settings: VisionSettings, pixels: Callable[[], np.ndarray],
                  name: str) -> FrameLayout:
    """`Family.refine_layout`: with `small_image_upsize` "adaptive", an unsliced image's size, or
    the slices that an adaptive tile replaces, from the image's glyphs."""
    if settings.small_image_upsize != "adaptive":
        return layout
    image = pixels()
    if len(layout.views) == 1:
        resolution = glyph_resolution(image, settings.scale_resolution, name)
        size = minicpmv.best_resize(*image.shape[:2], settings, allow_upscale=resolution is not None,
                                    resolution=resolution)
        return dataclasses.replace(layout, views=(View(size),))
    refine = layout.views[1]
    tiles = tuple(_tile(image, refine, r, c, settings, name) for r in range(refine.rows) for c in range(refine.cols))
    return dataclasses.replace(layout, tiles=tiles) if any(tiles) else layout


MINICPM_OCR = dataclasses.replace(
    minicpmv.MINICPMV4_6, name="minicpm_ocr", model_types=("minicpm_ocr",),
    tower="triton_vlm.vision.minicpmv:MiniCPMOcrTower", decoder="triton_vlm.llm.decoders:QWEN3_5_TIED",
    refine_layout=refine_layout,
    vision_defaults={**minicpmv.MINICPMV4_6.vision_defaults, "downsample_mode": "4x"})
