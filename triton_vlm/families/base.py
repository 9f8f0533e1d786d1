"""What every family provides. Shared mechanisms take a `Family` and never branch on its name."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from triton_vlm.evs import retained_tokens
from triton_vlm.imaging import View, VisionSettings
from triton_vlm.mrope import MediaSpan


@dataclass(frozen=True)
class MediaLayout:
    """What `Family.expand_media` sees of one media item."""
    video: bool
    index: int                          # among the prompt's items of its kind (images or videos)
    token: int                          # its placeholder token's id
    grids: list[tuple[int, int, int]]   # its grid_thw rows (vision patches), prompt order
    views: tuple[View, ...]             # each frame's views (`Family.slice_rule`)
    num_frames: int
    settings: VisionSettings
    timestamps: np.ndarray | None = None  # a video's sampled frames, in seconds
    t_factor: float = 1.0               # M-RoPE temporal scale (`Family.video_t_factor`)
    pruning_rate: float = 0.0           # EVS video pruning (`Family.video_pruning`; triton_vlm.evs)
    source: tuple[int, int] | None = None  # an image's own (height, width), as decoded

    @property
    def merged_grid(self) -> tuple[int, int, int]:
        """The LLM grid (t, h, w) after the spatial merge, of an item with one grid row."""
        (t, h, w), m = self.grids[0], self.settings.merge_size
        return t, h // m, w // m


def expand_plain(media: MediaLayout, token_id: Callable[[str], int],
                 encode: Callable[[list[str]], list[list[int]]]) -> tuple[np.ndarray, list[MediaSpan]]:
    """One placeholder token per merged grid token (`merged_grid`), one span; with EVS pruning, as
    many as the encoder will keep (`evs.retained_tokens`)."""
    t, h, w = media.merged_grid
    n = retained_tokens(t, h * w, media.pruning_rate)
    span = MediaSpan(0, t, h, w, media.t_factor, tokens=None if n == t * h * w else n)
    return np.full(n, media.token, dtype=np.int32), [span]


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    # Placeholder strings a prompt holds once per media item, as the HF processor accepts them.
    image_placeholder: str
    video_placeholder: str
    # Special tokens the tokenizer must encode as single ids, and the named ones
    # (`image_token`, `video_token`, ...) that HF processors read off the tokenizer.
    special_tokens: tuple[str, ...]
    named_special_tokens: dict[str, str]
    # (pixel_values row width, embedding width) from the checkpoint's config.json.
    encoder_dims: Callable[[dict], tuple[int, int]]
    # Its vision tower class (`triton_vlm.vision.tower.Tower`) and decoder (`triton_vlm.llm.decoders.
    # DecoderSpec`) as "module:name", imported when used (`tower_class`, `decoder_spec`): the
    # preprocess model needs neither.
    tower: str
    decoder: str
    # Video frame sampling (`preprocess`): `sample_frames(metadata, *, fps, num_frames, min_frames,
    # max_frames, temporal_patch_size) -> increasing frame indices`; videos are always sampled, at
    # `default_video_fps` unless the request or the checkpoint's processor config says otherwise.
    # Indices are distinct: a last temporal patch short of frames repeats its last one (the patchifier
    # pads it), which is what HF's "append the last index to make the count even" gives.
    sample_frames: Callable[..., Any] | None = None
    default_video_fps: float = 2.0
    # Video processor config keys `sample_frames` also takes (as keyword arguments) where the
    # checkpoint sets them, e.g. GLM-4.1V's `max_duration`.
    video_sampler_keys: tuple[str, ...] = ()
    # Target frame size: `resize_rule(height, width, settings, num_frames, name) -> (h, w)`
    # (`triton_vlm.imaging.ResizeRule`); None: Qwen2-VL's `smart_resize`, frame by frame.
    resize_rule: Callable[..., tuple[int, int]] | None = None
    # Sliced images (MiniCPM-V): `slice_rule(height, width, settings, name) -> views` (`View`s: an
    # overview, then the slices); each slice of each frame is then its own grid row [1, h, w] (see
    # `triton_vlm.imaging.FrameLayout`). None: one view of `resize_rule`'s size per item.
    slice_rule: Callable[..., tuple[View, ...]] | None = None
    # `VisionSettings` values where the processor config leaves them out (the family's processor
    # class defaults that the config does not store, e.g. MiniCPM-V's temporal_patch_size 1).
    vision_defaults: dict[str, Any] = field(default_factory=dict)
    # More of them by the section's processor class (`image_processor_type`, `video_processor_type`),
    # where the family's checkpoints ship several (LLaVA's CLIP and SigLIP image processors).
    processor_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    # (min_pixels, max_pixels) of images and of video frames where a processor config gives no size:
    # the family's transformers processor class defaults (Qwen2-VL's here).
    image_size_default: tuple[int, int] = (56 * 56, 28 * 28 * 1280)
    video_size_default: tuple[int, int] = (128 * 28 * 28, 28 * 28 * 768)
    # What a media item's placeholder token becomes: `expand_media(media: MediaLayout, token_id,
    # encode) -> (ids int32 [n], spans)`, `token_id(token) -> id`, `encode(texts) -> ids per text`
    # (no special tokens added), `spans` the `MediaSpan`s of its embedding runs, offsets relative to
    # the first id. Default: `expand_plain`.
    expand_media: Callable[..., tuple[np.ndarray, list[MediaSpan]]] = expand_plain
    # M-RoPE temporal scale of a video: `video_t_factor(config_json, second_per_grid_ts)`.
    video_t_factor: Callable[[dict, float], float] | None = None
    # Generation stops on these; the first is the tokenizer's eos. The pad token is special_tokens[0].
    eos_tokens: tuple[str, ...] = ()
    # Video processor classes (`video_processor_type`) that pick this family among several sharing a
    # `model_type`; see `detect_family`.
    video_processor_types: tuple[str, ...] = ()
    # EVS video pruning (`video_pruning_rate`, triton_vlm.evs) as the reference implements it for
    # this family; others refuse the option.
    video_pruning: bool = False
    # The image and video placeholders are strings of several tokens (MiniCPM-V 4.5's
    # `(<image>./</image>)`), found in the prompt's text rather than among its token ids.
    placeholders_in_text: bool = False
    # The checkpoint's chat template takes string content only (MiniCPM-V 4.5's official one): a
    # message's parts are joined into one string by newlines, each media part as its placeholder,
    # as the official `chat()` writes them.
    chat_content_as_text: bool = False
    # Variables the chat template is rendered with, as the official chat passes them (MiniCPM-V
    # 4.5's `chat(enable_thinking=False)`).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The config `version`s served, where one `model_type` spans versions (MiniCPM-V's `minicpmv`:
    # 2.0 to 4.5); empty: any.
    versions: tuple[str, ...] = ()
    # An image's views from its pixels, where its size alone does not fix them (MiniCPM-OCR's
    # adaptive sizes): `refine_layout(layout, settings, pixels, name) -> FrameLayout`, `layout` the
    # `slice_rule`'s, `pixels()` the decoded uint8 image [H, W, 3] (decoded on the first call).
    refine_layout: Callable[..., Any] | None = None
    # Positions laid out over the whole expanded prompt instead of from the `MediaSpan`s (MiniCPM-V
    # 4.7's canvas M-RoPE): `prompt_positions(input_ids, kinds, grid_thw, config_json) -> (positions
    # int64 [3, S], delta)`, `kinds` per token 0 text, 1 image, 2 video (HF's `mm_token_type_ids`).
    prompt_positions: Callable[..., tuple[np.ndarray, int]] | None = None
    # Whether requests may hold videos (a family whose processor takes images only refuses them).
    takes_videos: bool = True
    # `VisionSettings` values a video's frames take over the processor config's (MiniCPM-V 4.5's
    # official "chat with video": no slices, no image ids).
    video_settings: dict[str, Any] = field(default_factory=dict)
    # Packed video frames (MiniCPM-V 4.5): `pack_frames(metadata, *, fps, force_packing) -> temporal
    # ids per group`, for the sampled frames (`metadata.frames_indices`, in order) in the groups the
    # tower resamples together: one grid row [frames, h, w] per group, each frame's temporal id
    # carried to the tower (`temporal_ids`). None: frames are not packed, and `force_packing` is
    # refused.
    pack_frames: Callable[..., list[list[int]]] | None = None
    # `VisionSettings` values every image of a prompt with several takes over the processor config's
    # (LLaVA-OneVision's processor: no tiles, padded to a square).
    several_images_settings: dict[str, Any] = field(default_factory=dict)
    # Each item's grid rows (an image's views and slices, a video's frames) are packed into one grid
    # row [rows, h, w], which the tower takes whole (`Tower.PACKED_FRAMES`; LLaVA-OneVision's base
    # view and tiles, a video's frames before their one newline).
    pack_views: bool = False
    # Each grid row's image size (height, width; a video's (0, 0)) goes from preprocess to the tower
    # (`image_sizes`, `Tower.IMAGE_SIZES`: LLaVA-OneVision unpads the tiles' features by it).
    image_sizes: bool = False
    # What sizes images where the request's `min_pixels` / `max_pixels` play no part (they are then
    # refused naming it); empty: they apply (or the family's `slice_rule` says why not).
    sized_by: str = ""
    # Decoders by the checkpoint's `text_config.model_type`, for a family whose checkpoints pair its
    # tower with several language models (LLaVA: llama, qwen2); empty: `decoder` serves every one.
    text_decoders: dict[str, str] = field(default_factory=dict)

    def tower_class(self) -> type:
        return _import(self.tower)

    def decoder_spec(self, text_model_type: str = "") -> Any:
        """The decoder of a checkpoint whose `text_config.model_type` is `text_model_type`."""
        if not self.text_decoders:
            return _import(self.decoder)
        if text_model_type not in self.text_decoders:
            raise ValueError(f"{self.name}: text_config.model_type {text_model_type!r} is not supported; "
                             f"supported: {', '.join(self.text_decoders)}")
        return _import(self.text_decoders[text_model_type])


def _import(path: str) -> Any:
    """The object a "module:name" path names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def patch_encoder_dims(config: dict) -> tuple[int, int]:
    """`Family.encoder_dims` of Qwen2-VL-style towers (GLM's too): a row holds in_channels *
    temporal_patch_size * patch_size^2 pixel values; embeddings are out_hidden_size wide."""
    vision = config["vision_config"]
    patch_dim = vision.get("in_channels", 3) * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    return patch_dim, vision["out_hidden_size"]
