"""What every family provides, as the shared mechanisms see it: a `Family` (its name, the
checkpoints it serves, its `Prompt`, its `ProcessorRules`, and where its tower, decoder and demo
live). Shared mechanisms take a `Family` and never branch on its name; each family folder
(`triton_vlm.families.<name>`) defines its own.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from triton_vlm.media.evs import check_rate, retained_tokens
from triton_vlm.media.frames import View
from triton_vlm.media.mrope import MediaSpan, after_max
from triton_vlm.media.sizing import VisionSettings


@dataclass(frozen=True)
class MediaLayout:
    """What `ProcessorRules.expand_media` sees of one media item."""
    video: bool
    index: int                          # among the prompt's items of its kind (images or videos)
    token: int                          # its placeholder token's id
    grids: list[tuple[int, int, int]]   # its grid_thw rows (vision patches), prompt order
    views: tuple[View, ...]             # each frame's views (`ProcessorRules.slice_rule`)
    num_frames: int
    settings: VisionSettings
    timestamps: np.ndarray | None = None  # a video's sampled frames, in seconds
    t_factor: float = 1.0               # M-RoPE temporal scale (`ProcessorRules.video_t_factor`)
    pruning_rate: float = 0.0           # EVS video pruning (`ProcessorRules.video_pruning`; triton_vlm.media.evs)
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
class Prompt:
    """How a family's prompts hold media, as its tokenizer and chat template see them."""
    # Placeholder strings a prompt holds once per media item, as the HF processor accepts them.
    image_placeholder: str
    video_placeholder: str
    # Special tokens the tokenizer must encode as single ids (the pad token is the first), and the
    # named ones (`image_token`, `video_token`, ...) that HF processors read off the tokenizer.
    special_tokens: tuple[str, ...]
    named_special_tokens: dict[str, str]
    # Generation stops on these; the first is the tokenizer's eos.
    eos_tokens: tuple[str, ...] = ()
    # The image placeholder's named special token and the config key that may give its id (Gemma 3's
    # prompts hold `boi_token`, `<start_of_image>`, which its processor expands into the image run).
    image_placeholder_token: tuple[str, str] = ("image_token", "image_token_id")
    # Text the expanded prompt holds before every video's media (InternVL's "Frame1: "): put before
    # each video placeholder in the text, so that it is encoded with the text before it, as the
    # processor encodes its expanded prompt.
    video_prefix: str = ""
    # The image and video placeholders are strings of several tokens, found in the prompt's text
    # rather than among its token ids.
    placeholders_in_text: bool = False
    # The checkpoint's chat template takes string content only: a message's parts are joined into
    # one string by newlines, each media part as its placeholder, as an official `chat()` writes them.
    chat_content_as_text: bool = False
    # Variables the chat template is rendered with, as the official chat passes them.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # How the answer writes tool calls where the chat template renders tools: "hermes" (Qwen's
    # `<tool_call>` JSON) or "glm45" (`triton_vlm.clients.tool_calls`); None: no tool calling.
    tool_call_format: str | None = None
    # The chat format of checkpoints that ship no chat template (their official `chat()`'s), as a
    # Jinja template; None: a checkpoint without one has none.
    chat_template: str | None = None


@dataclass(frozen=True)
class ProcessorRules:
    """The family's processor as `preprocess` follows it: how videos are sampled, how frames are
    sized, sliced and packed, and what each placeholder token becomes."""
    # What a media item's placeholder token becomes: `expand_media(media: MediaLayout, token_id,
    # encode) -> (ids int32 [n], spans)`, `token_id(token) -> id`, `encode(texts) -> ids per text`
    # (no special tokens added), `spans` the `MediaSpan`s of its embedding runs, offsets relative to
    # the first id.
    expand_media: Callable[..., tuple[np.ndarray, list[MediaSpan]]] = expand_plain
    # Video frame sampling: `sample_frames(metadata, *, fps, num_frames, min_frames, max_frames,
    # temporal_patch_size) -> increasing frame indices`; videos are always sampled, at
    # `default_video_fps` unless the request or the checkpoint's processor config says otherwise.
    # Indices are distinct: a last temporal patch short of frames repeats its last one (the patchifier
    # pads it), which is what HF's "append the last index to make the count even" gives. None: every
    # frame is taken, and the sampling options are refused.
    sample_frames: Callable[..., Any] | None = None
    # None: the video processor has no rate of its own (Qwen2-VL's): a video is sampled where its
    # config says `do_sample_frames` (at its `fps` or `num_frames`) or the request gives a rate or a
    # count, and otherwise every frame is taken (`sample_frames` given neither).
    default_video_fps: float | None = 2.0
    # Video processor config keys `sample_frames` also takes (as keyword arguments) where the
    # checkpoint sets them.
    video_sampler_keys: tuple[str, ...] = ()
    # Target frame size: `resize_rule(height, width, settings, num_frames, name) -> (h, w)`
    # (`triton_vlm.media.sizing.ResizeRule`); None: Qwen2-VL's `smart_resize`, frame by frame.
    resize_rule: Callable[..., tuple[int, int]] | None = None
    # Sliced images: `slice_rule(height, width, settings, name) -> views` (`View`s: an overview, then
    # the slices); each slice of each frame is then its own grid row [1, h, w] (see
    # `triton_vlm.media.frames.FrameLayout`). None: one view of `resize_rule`'s size per item.
    slice_rule: Callable[..., tuple[View, ...]] | None = None
    # An image's views from its pixels, where its size alone does not fix them: `refine_layout(layout,
    # settings, pixels, name) -> FrameLayout`, `layout` the `slice_rule`'s, `pixels()` the decoded
    # uint8 image [H, W, 3] (decoded on the first call).
    refine_layout: Callable[..., Any] | None = None
    # `VisionSettings` values where the processor config leaves them out (the processor class's own
    # defaults that its config does not store).
    vision_defaults: dict[str, Any] = field(default_factory=dict)
    # `VisionSettings` values the processor class sets over whatever its config says (its own
    # `images_kwargs`, which win over the saved image processor config: Gemma 3's pan-and-scan).
    processor_settings: dict[str, Any] = field(default_factory=dict)
    # Boolean `VisionSettings` fields a request may set for its images (`mm_options`, as
    # transformers' processor keywords: Gemma 3's `do_pan_and_scan`); other families refuse them.
    image_flags: tuple[str, ...] = ()
    # The text each image placeholder becomes (`expand_text(media) -> str`), the whole prompt then
    # encoded in one piece, as processors
    # that expand placeholders in the text before tokenizing do (Gemma 3's `\n\n` around the image
    # run merges with its neighbours); None: `expand_media` splices ids. Its spans are none: the
    # family's positions are the plain 0..S-1.
    expand_text: Callable[..., str] | None = None
    # `VisionSettings` fields read from the model's config.json (field -> key) where the processor
    # config leaves them out: models that process images in their own code keep these settings there.
    config_settings: dict[str, str] = field(default_factory=dict)
    # The images a prompt may hold (0: as many as the limits allow), for processors that take fewer.
    max_images: int = 0
    # `VisionSettings` values a video's frames take over the processor config's.
    video_settings: dict[str, Any] = field(default_factory=dict)
    # `VisionSettings` values every image of a prompt with several takes over the processor config's.
    several_images_settings: dict[str, Any] = field(default_factory=dict)
    # More `vision_defaults` by the section's processor class (`image_processor_type`,
    # `video_processor_type`), where the family's checkpoints ship several.
    processor_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    # With the video processor config's `cap_pixels_per_frame`: the settings of a video of n frames
    # (`video_cap(settings, max_video_tokens, n) -> VisionSettings`); None: Qwen2-VL's per-frame cap
    # (`triton_vlm.preprocessing.items.frame_settings`). `max_video_tokens` where the config has none.
    video_cap: Callable[..., Any] | None = None
    max_video_tokens: int = 128000
    # (min_pixels, max_pixels) of images and of video frames where a processor config gives no size:
    # the family's transformers processor class defaults (Qwen2-VL's here).
    image_size_default: tuple[int, int] = (56 * 56, 28 * 28 * 1280)
    video_size_default: tuple[int, int] = (128 * 28 * 28, 28 * 28 * 768)
    # What sizes images where the request's `min_pixels` / `max_pixels` play no part (they are then
    # refused naming it); empty: they apply (or the `slice_rule` says why not).
    sized_by: str = ""
    # Whether requests may hold videos (a processor that takes images only refuses them).
    takes_videos: bool = True
    # M-RoPE temporal scale of a video: `video_t_factor(config_json, second_per_grid_ts)`.
    video_t_factor: Callable[[dict, float], float] | None = None
    # Where the text after a media span starts (`triton_vlm.media.mrope`): the reference's
    # max + 1 (`after_max`), or transformers' base + max(h', w') (`after_extent`).
    mrope_text_after: Callable[..., int] = after_max
    # Positions laid out over the whole expanded prompt instead of from the `MediaSpan`s:
    # `prompt_positions(input_ids, kinds, grid_thw, config_json) -> (positions int64 [3, S], delta)`,
    # `kinds` per token 0 text, 1 image, 2 video (HF's `mm_token_type_ids`).
    prompt_positions: Callable[..., tuple[np.ndarray, int]] | None = None
    # EVS video pruning (`video_pruning_rate`, triton_vlm.media.evs) as the reference implements it for
    # this family; others refuse the option.
    video_pruning: bool = False
    # Packed video frames: `pack_frames(metadata, *, fps, force_packing) -> temporal ids per group`,
    # for the sampled frames (`metadata.frames_indices`, in order) in the groups the tower resamples
    # together: one grid row [frames, h, w] per group, each frame's temporal id carried to the tower
    # (`temporal_ids`). None: frames are not packed, and `force_packing` is refused.
    pack_frames: Callable[..., list[list[int]]] | None = None
    # Each item's grid rows (an image's views and slices, a video's frames) are packed into one grid
    # row [rows, h, w], which the tower takes whole (`Tower.PACKED_FRAMES`).
    pack_views: bool = False
    # Each grid row's image size (height, width; a video's (0, 0)) goes from preprocess to the tower
    # (`image_sizes`, `Tower.IMAGE_SIZES`).
    image_sizes: bool = False
    # Every frame of a request is zero-padded to the request's largest frame (its h * w patches) in
    # the tower, which then attends over the padding too (`padded_patches`, `Tower.EXTRAS`): what
    # MiniCPM-V 2.5's official batched vision call computes.
    padded_patches: bool = False


@dataclass(frozen=True)
class Family:
    """One family (or one version or variant of it): what checkpoints it serves, its prompts, its
    processor, and its tower, decoder and demo checkpoint, named as "module:name" and imported when
    used (`tower_class`, `decoder_spec`, `demo_spec`: the preprocess model needs none of them)."""
    name: str
    # The checkpoints' config `model_type`s it serves; where a `model_type` spans versions, the
    # config `version`s it serves (empty: any), and the video processor classes that pick it among
    # families sharing a `model_type` (`triton_vlm.families.detect_family`).
    model_types: tuple[str, ...]
    prompt: Prompt
    processor: ProcessorRules
    # (pixel_values row width, embedding width) from the checkpoint's config.json.
    encoder_dims: Callable[[dict], tuple[int, int]]
    # Its `triton_vlm.vision.tower.base.Tower` class; its `triton_vlm.llm.layers.spec.DecoderSpec`, or one by
    # the checkpoint's `text_config.model_type` where its checkpoints pair the tower with several
    # language models; its demo checkpoints (a `triton_vlm.families.demo.Demo` by family name).
    tower: str
    decoder: str | Mapping[str, str]
    demo: str
    versions: tuple[str, ...] = ()
    video_processor_types: tuple[str, ...] = ()
    # How a checkpoint's `config.json` names its version (what `versions` holds).
    config_version: Callable[[dict], str] = lambda config: str(config.get("version"))

    @property
    def image_placeholder(self) -> str:
        return self.prompt.image_placeholder

    @property
    def video_placeholder(self) -> str:
        return self.prompt.video_placeholder

    def tower_class(self) -> type:
        return _import(self.tower)

    def decoder_spec(self, text_model_type: str = "") -> Any:
        """The decoder of a checkpoint whose `text_config.model_type` is `text_model_type`."""
        if isinstance(self.decoder, str):
            return _import(self.decoder)
        if text_model_type not in self.decoder:
            raise ValueError(f"{self.name}: text_config.model_type {text_model_type!r} is not supported; "
                             f"supported: {', '.join(self.decoder)}")
        return _import(self.decoder[text_model_type])

    def demo_spec(self) -> Any:
        """Its demo checkpoint (`triton_vlm.families.demo.Demo`)."""
        return _import(self.demo)[self.name]

    def pruning_rate(self, rate: Any, name: str) -> float:
        """A video pruning rate for this family (ValueError naming `name` unless in [0, 1) and, when
        above 0, the family prunes videos)."""
        rate = check_rate(rate, name)
        if rate > 0 and not self.processor.video_pruning:
            raise ValueError(f"{name} does not apply: {self.name} has no video pruning")
        return rate


def _import(path: str) -> Any:
    """The object a "module:name" path names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def patch_encoder_dims(config: dict, out_key: str = "out_hidden_size") -> tuple[int, int]:
    """`Family.encoder_dims` of towers whose row is one patch of `temporal_patch_size` frames: a row
    holds in_channels * temporal_patch_size * patch_size^2 pixel values; embeddings are as wide as
    the vision config's `out_key` says (Qwen2-VL's: `hidden_size`)."""
    vision = config["vision_config"]
    patch_dim = vision.get("in_channels", 3) * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    return patch_dim, vision[out_key]
