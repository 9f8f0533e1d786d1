"""Gemma 3's processor rules (transformers `gemma3`: `Gemma3Processor`, `Gemma3ImageProcessor`).

The prompt holds `<start_of_image>` (the tokenizer's `boi_token`) once per image. Each becomes
`\\n\\n<start_of_image>` + `<image_soft_token>` x `mm_tokens_per_image` + `<end_of_image>\\n\\n` in the
text, which is then tokenized whole with the tokenizer's `<bos>` (`expand_text`: the newlines merge
with the text around them as the tokenizer merges them). Every image is resized to the tower's
square (`size.height` x `size.width`, bilinear, the aspect ratio not kept) and normalised with mean
and std 0.5. With pan-and-scan (`mm_options {"do_pan_and_scan": true}`: `Gemma3Processor` turns it
off whatever its config says, so only a request turns it on) a long image also gives 2..4 crops
along its longer side (`pan_and_scan`), each resized to the square after the whole image, and its
text becomes `Here is the original image ` + the run + ` and here are some crops to help you see
better ` + one run per crop, joined by spaces. Images only: a video is refused naming `videos`.

`preprocess` outputs (the contract's, for this family): `grid_thw` one row `[1, S, S]` per view (the
whole image, then its crops), S = image_size / patch_size; `pixel_values` float32 one row per patch
in raster order, each row (channel, dy, dx) (`triton_vlm.families.llava.tower.patch_rows` of
transformers' [B, 3, H, W]); positions plain 0..S-1 on three rows, delta 0.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from triton_vlm.errors import InvalidInput
from triton_vlm.families.base import MediaLayout
from triton_vlm.media.frames import View
from triton_vlm.media.sizing import VisionSettings

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"


def encoder_dims(config: dict) -> tuple[int, int]:
    """(patch row width, embedding width): channels * patch^2 pixels, the text model's hidden size."""
    vision = config["vision_config"]
    return vision.get("num_channels", 3) * vision["patch_size"] ** 2, config["text_config"]["hidden_size"]


def pan_and_scan(height: int, width: int, settings: VisionSettings) -> list[tuple[int, int, int, int]]:
    """`Gemma3ImageProcessor.pan_and_scan_batched`'s crops of an image, as (top, bottom, left, right)
    regions, row-major; none unless the image is long enough and every crop large enough."""
    landscape = width >= height
    long, short = (width, height) if landscape else (height, width)
    if long / short < settings.pan_and_scan_min_ratio_to_activate:
        return []
    n = min(int(math.floor(long / short + 0.5)), int(math.floor(long / settings.pan_and_scan_min_crop_size)))
    n = min(settings.pan_and_scan_max_num_crops, max(2, n))
    crop_w, crop_h = (int(math.ceil(width / n)), height) if landscape else (width, int(math.ceil(height / n)))
    if min(crop_w, crop_h) < settings.pan_and_scan_min_crop_size:
        return []
    return [(top, min(top + crop_h, height), left, min(left + crop_w, width))
            for top in range(0, crop_h * (1 if landscape else n), crop_h)
            for left in range(0, crop_w * (n if landscape else 1), crop_w)]


def slice_rule(height: int, width: int, settings: VisionSettings, name: str) -> tuple[View, ...]:
    """The whole image resized to the square, then (with `do_pan_and_scan`) each crop resized to it."""
    if height <= 0 or width <= 0:
        raise InvalidInput(f"{name}: image has no pixels")
    if not all(settings.resize_to):
        raise ValueError("Gemma 3: the image processor config has no size.height and size.width")
    size = settings.resize_to
    crops = pan_and_scan(height, width, settings) if settings.do_pan_and_scan else []
    return (View(size),) + tuple(View(size, region=region) for region in crops)


def expand_text(media: MediaLayout) -> str:
    """`Gemma3Processor.replace_image_token`: the image's run, and with pan-and-scan crops the
    original's and each crop's, worded as the processor words them."""
    run = f"\n\n{BOI}{IMAGE_TOKEN * media.settings.num_image_tokens}{EOI}\n\n"
    crops = len(media.views) - 1
    if not crops:
        return run
    return f"Here is the original image {run} and here are some crops to help you see better " + " ".join([run] * crops)


def embedding_rows(grid_thw: np.ndarray, settings: dict[str, Any],
                   extras: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """The tower's rows of each grid row (`Tower.ROWS`, numpy only for the encoder front): every
    view pooled to `mm_tokens_per_image` tokens, whatever its patches."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return grid[:, 0] * int(settings["mm_tokens_per_image"])
