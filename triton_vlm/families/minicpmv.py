"""MiniCPM-V 4.6 (transformers `minicpmv4_6`): a SigLIP-style vision tower with per-slice sizes,
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
from triton_vlm.families.base import Family, MediaLayout
from triton_vlm.imaging import View, VisionSettings
from triton_vlm.media import distinct_indices, video_facts
from triton_vlm.mrope import MediaSpan

IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
IMAGE_START, IMAGE_END = "<image>", "</image>"
SLICE_START, SLICE_END = "<slice>", "</slice>"
IMAGE_ID_START, IMAGE_ID_END = "<image_id>", "</image_id>"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, IMAGE_TOKEN, VIDEO_TOKEN, IMAGE_START, IMAGE_END,
                  SLICE_START, SLICE_END, IMAGE_ID_START, IMAGE_ID_END)
NAMED_TOKENS = {"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN, "image_start_token": IMAGE_START,
                "image_end_token": IMAGE_END, "slice_start_token": SLICE_START, "slice_end_token": SLICE_END,
                "image_id_start_token": IMAGE_ID_START, "image_id_end_token": IMAGE_ID_END}

def encoder_dims(config: dict) -> tuple[int, int]:
    vision = config["vision_config"]
    return vision.get("num_channels", 3) * vision["patch_size"] ** 2, config["text_config"]["hidden_size"]


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


# ------------------------------------------------------------------------------- frame sampling

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


# ---------------------------------------------------------------------------------- the prompt

def expand_media(media: MediaLayout, token_id: Callable[[str], int],
                 encode: Callable[[list[str]], list[list[int]]]) -> tuple[np.ndarray, list[MediaSpan]]:
    """The ids an image or video token becomes (`MiniCPMV4_6Processor.replace_image_token`,
    `replace_video_token`, `_prepend_local_ids`): see `slice_runs`, each run of the item's own
    token."""
    return slice_runs(media, media.token, token_id, encode)


def slice_runs(media: MediaLayout, fill: int, token_id: Callable[[str], int],
               encode: Callable[[list[str]], list[list[int]]]) -> tuple[np.ndarray, list[MediaSpan]]:
    """`<image_id>N</image_id>` (N the item's index among its kind; with `use_image_id`), then per
    frame `<image>` + the overview's run of `fill` tokens + `</image>` and the slices' `<slice>` +
    run + `</slice>`, slice rows joined by a newline (MiniCPM-V's processors, 2.6 to 4.6). No
    spans: media tokens take text positions (the model's positions are plain 0..S-1)."""
    start, end = token_id(IMAGE_START), token_id(IMAGE_END)
    slice_start, slice_end = token_id(SLICE_START), token_id(SLICE_END)
    index_ids, newline = encode([str(media.index), "\n"])
    runs = iter([_run_tokens(media.settings, h, w) for _, h, w in media.grids])
    ids: list[int] = [token_id(IMAGE_ID_START), *index_ids, token_id(IMAGE_ID_END)] if media.settings.use_image_id else []
    sliced = media.views[1:]
    for _ in range(media.num_frames):
        ids += [start, *[fill] * next(runs), end]
        for view in sliced:
            for r in range(view.rows):
                if r:
                    ids += newline
                for _ in range(view.cols):
                    ids += [slice_start, *[fill] * next(runs), slice_end]
    return np.asarray(ids, dtype=np.int32), []


MINICPMV4_6 = Family(
    name="minicpmv4_6",
    model_types=("minicpmv4_6",),
    image_placeholder=IMAGE_TOKEN,
    video_placeholder=VIDEO_TOKEN,
    special_tokens=SPECIAL_TOKENS,
    named_special_tokens=NAMED_TOKENS,
    encoder_dims=encoder_dims,
    tower="triton_vlm.vision.minicpmv:MiniCPMV4_6Tower",
    decoder="triton_vlm.llm.decoders:QWEN3_5",
    eos_tokens=(IM_END, ENDOFTEXT),
    slice_rule=slice_rule,
    sample_frames=sample_frames,
    video_sampler_keys=("max_num_frames", "stack_frames"),
    expand_media=expand_media,
    # Each frame is its own image (no temporal patches) and patches stay in raster order; the
    # processor's own class defaults for what its config leaves out.
    vision_defaults=dict(temporal_patch_size=1, merge_size=1, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5)),
)
