"""How frames are sized: the processor settings `preprocess` works with (`VisionSettings`, read from
a checkpoint's processor config), transformers' `smart_resize`, and the grid a sized frame makes.
The families' processor rules size and slice with these (`ProcessorRules.resize_rule`,
`slice_rule`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from triton_vlm.errors import InvalidInput


@dataclass(frozen=True)
class VisionSettings:
    """One processor section (image or video) of a checkpoint's processor config."""
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    # Sizes snap to multiples of patch_size * merge_size * patch_expand_factor (1: of patch * merge).
    patch_expand_factor: int = 1
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3
    # Sliced-image processors: slices of about `scale_resolution`^2 pixels, at most
    # `max_slice_nums`; `downsample_mode` "16x" (4 x 4 patches per LLM token) or "4x" (2 x 2), or
    # "resampler" (`image_feature_size` tokens per slice, whatever its size);
    # `use_image_id` numbers each item in the prompt.
    scale_resolution: int = 448
    max_slice_nums: int = 9
    slice_mode: bool = True
    downsample_mode: str = "16x"
    use_image_id: bool = True
    image_feature_size: int = 64
    # A sliced image's grid in one `<slice>` ... `</slice>`, each slice's run between `<image>` and
    # `</image>` (MiniCPM-V 2.0, 2.5), rather than each slice in its own `<slice>` ... `</slice>`.
    grid_in_one_slice: bool = False
    # How an image or slice no larger than `scale_resolution`^2 is sized: "always" upscaled to
    # it, "never" kept native, "adaptive" by its glyphs (`ProcessorRules.refine_layout`).
    small_image_upsize: str = "always"
    # How the processor computes pixels: "torchvision" (transformers' processors: torch's resize,
    # rescale fused into the normalisation) or "pil" (processors written on PIL images and numpy,
    # as official remote-code processors are: Pillow's resize of each uint8 frame, then x / 255, then
    # (x - mean) / std in float32). The resizes differ by one level in places.
    backend: str = "torchvision"
    # CLIP-style processors (`CLIPImageProcessor`): the shorter side resized to
    # `shortest_edge` pixels, the aspect ratio kept (`size.shortest_edge`), then with
    # `do_center_crop` the centre `crop_size` (height, width) cut out.
    shortest_edge: int = 0
    do_center_crop: bool = False
    crop_size: tuple[int, int] = (0, 0)
    # Processors that resize every image to one (height, width) (`size.height`, `size.width`:
    # SigLIP's `SiglipImageProcessor`); (0, 0): none.
    resize_to: tuple[int, int] = (0, 0)
    # `LlavaImageProcessor`'s padding to a square before the resize (not supported: refused).
    do_pad: bool = False
    # A processor's own fields beside its image processor's: tokens an image adds beyond
    # one per patch (CLIP's class token: 1), and "default" (drop the first token) or "full" (what
    # the processor does when its config gives none).
    num_additional_image_tokens: int = 0
    vision_feature_select_strategy: str = "full"
    # Anyres image processors: tiles of the best of `image_grid_pinpoints` (height, width)
    # beside the base view; with none, `pad_to_square` (each image of a prompt with several) pads
    # the image to a square of the mean colour before the resize. "anyres_max_N": the tiles'
    # features are cut down to about N views' worth (the model's `vision_aspect_ratio`).
    image_grid_pinpoints: tuple[tuple[int, int], ...] = ()
    pad_to_square: bool = False
    vision_aspect_ratio: str = "anyres_max_9"
    num_image_tokens: int = 0   # an anyres processor's tokens per view
    # Pan-and-scan (Gemma 3's processor): beside the whole image, up to `pan_and_scan_max_num_crops`
    # crops along its longer side when that side is at least `pan_and_scan_min_ratio_to_activate`
    # times the shorter, none of them under `pan_and_scan_min_crop_size` pixels a side; only where
    # `do_pan_and_scan` (a request's `mm_options`).
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2
    # Tiling processors (`GotOcr2ImageProcessor`): an image cut into tiles of `resize_to`, between
    # `min_patches` and `max_patches` of them.
    min_patches: int = 1
    max_patches: int = 12
    # A video processor's own frame sampling (families whose processors take every frame by
    # default refuse it where a config turns it on).
    do_sample_frames: bool = False

    @property
    def center_crop(self) -> tuple[int, int] | None:
        """The (height, width) resized frames are cropped to, None without a crop."""
        return tuple(self.crop_size) if self.do_center_crop else None

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size * self.patch_expand_factor

    @property
    def row_size(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280, name: str = "input", num_frames: int = 1,
                 temporal_factor: int = 1) -> tuple[int, int]:
    """transformers' Qwen2-VL `smart_resize`; an aspect ratio over 200 raises `InvalidInput`. With
    `num_frames` and `temporal_factor`: the pixel budget covers all frames (a video's, as one budget)."""
    if height <= 0 or width <= 0:
        raise InvalidInput(f"{name}: image has no pixels")
    if max(height, width) / min(height, width) > 200:
        raise InvalidInput(f"{name}: aspect ratio {max(height, width) / min(height, width):.1f} "
                           f"exceeds max_aspect_ratio=200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# A family's resize rule: (height, width, settings, num_frames, name) -> (height, width) to resize to.
ResizeRule = Callable[[int, int, VisionSettings, int, str], tuple[int, int]]


def qwen2_vl_resize(height: int, width: int, settings: VisionSettings, num_frames: int, name: str) -> tuple[int, int]:
    """Qwen2-VL's rule: every frame on its own (the frame count plays no part)."""
    return smart_resize(height, width, settings.factor, settings.min_pixels, settings.max_pixels, name)


def target_size(height: int, width: int, settings: VisionSettings, name: str, num_frames: int = 1,
                rule: ResizeRule | None = None) -> tuple[int, int]:
    """The (height, width) `num_frames` frames (1 for an image) are resized to, by the family's
    `rule` (default: Qwen2-VL's)."""
    if not settings.do_resize:
        f = settings.factor
        if height % f or width % f:
            raise InvalidInput(f"{name}: {width}x{height} is not a multiple of {f} and resizing is off")
        return height, width
    return (rule or qwen2_vl_resize)(height, width, settings, num_frames, name)


def grid_thw(num_frames: int, size: tuple[int, int], settings: VisionSettings) -> tuple[int, int, int]:
    """Patch grid of `num_frames` frames resized to `size` (frames padded to temporal_patch_size)."""
    tps = settings.temporal_patch_size
    return (num_frames + tps - 1) // tps, size[0] // settings.patch_size, size[1] // settings.patch_size
