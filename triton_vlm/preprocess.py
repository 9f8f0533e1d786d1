"""The `preprocess` step: prompt text + encoded media -> input_ids, pixel_values, grid_thw, M-RoPE.

Built once per checkpoint from its own files (config.json, processor_config.json or the older
preprocessor_config.json, tokenizer.json); each call is one request. Family rules come from the
`Family` that `detect_family` returns; nothing here branches on a family's name.

Outputs equal the Hugging Face processor's (`input_ids`, `pixel_values` / `pixel_values_videos`
rows in prompt order, `image_grid_thw` / `video_grid_thw` rows in prompt order); positions follow
the reference rule (see `triton_vlm.mrope`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from triton_vlm.errors import InvalidInput
from triton_vlm.evs import check_pruning
from triton_vlm.families import detect_family
from triton_vlm.families.base import Family, MediaLayout
from triton_vlm.imaging import FrameLayout, View, VisionSettings, target_size
from triton_vlm.limits import DEFAULT_LIMITS, Limits
from triton_vlm.media import (DemuxedVideo, PlannedVideo, decode_image, decode_item_bytes,
                              demux_video, frame_rgb, not_decodable_image, probe_image)
from triton_vlm.mrope import MediaSpan, mrope_positions, pruned_mrope_positions
from triton_vlm.options import PreprocessOptions
from triton_vlm.vision.batching import offsets

# Where a family's placeholders are text (`Family.placeholders_in_text`), the ids that stand for
# one in the prompt until it is expanded: no tokenizer gives a negative id.
IMAGE_MARK, VIDEO_MARK = -1, -2
MM_OPTION_KEYS = ("min_pixels", "max_pixels", "fps", "num_frames", "max_frames", "force_packing",
                  "video_pruning_rate")


@dataclass
class PreprocessOutput:
    input_ids: np.ndarray            # int32 [S]
    pixel_values: np.ndarray         # float32 [N, D]
    grid_thw: np.ndarray             # int64 [M, 3], prompt order
    mrope_position_ids: np.ndarray   # int64 [3, S]
    mrope_position_delta: int
    # With EVS pruning on (`video_pruning_rate` > 0): the unpruned positions of every media token,
    # prompt order, int64 [3, U]; the llm puts the kept ones' into `mrope_position_ids` (see
    # `triton_vlm.mrope.complete_positions`). Zero columns when pruning is off.
    media_position_ids: np.ndarray = field(default_factory=lambda: np.zeros((3, 0), np.int64))
    video_pruning_rate: float = 0.0
    # int64 [sum of grid_thw[:, 0]]: the temporal id of each frame of each grid row (a packed video
    # group's frames, `Family.pack_frames`), -1 where there is none.
    temporal_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # int64 [M, 2]: each grid row's image's own (height, width) where the family's tower unpads
    # images (`Family.image_sizes`); (0, 0) for a video's row and for every row otherwise.
    image_sizes: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))


def parse_mm_options(raw: dict | str | bytes | None) -> dict:
    """The request's `mm_options` (JSON text, or an already parsed object) as a dict; the one place
    they are parsed. InvalidInput unless a JSON object."""
    if raw is None or raw == b"" or raw == "":
        return {}
    if isinstance(raw, dict):
        return raw
    try:
        options = json.loads(raw)
    except json.JSONDecodeError as error:
        raise InvalidInput(f"mm_options: not valid JSON ({error.msg})") from None
    except (ValueError, TypeError):
        raise InvalidInput("mm_options: not a JSON object") from None
    if not isinstance(options, dict):
        raise InvalidInput("mm_options: not a JSON object")
    return options


@dataclass(frozen=True)
class VideoSampling:
    fps: float | None
    num_frames: int | None
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    # The family's extra sampler options from the processor config (`Family.video_sampler_keys`).
    extra: tuple[tuple[str, Any], ...] = ()
    # Frames per packed group, where the family packs them (`Family.pack_frames`); None: its rule.
    force_packing: int | None = None


def _settings(section: dict, size_default: tuple[int, int], family: Family) -> VisionSettings:
    """A processor section's settings; what it leaves out, its processor class's defaults."""
    processor_class = section.get("image_processor_type") or section.get("video_processor_type")
    defaults = {**family.vision_defaults, **family.processor_defaults.get(processor_class, {})}
    size = section.get("size") or {}
    min_pixels = section.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or size_default[0]
    max_pixels = section.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or size_default[1]
    base = VisionSettings(**defaults)
    values = {f.name: section[f.name] for f in dataclasses.fields(VisionSettings)
              if section.get(f.name) is not None and f.name not in ("min_pixels", "max_pixels")}
    for key, spelling in (("image_mean", "norm_mean"), ("image_std", "norm_std")):  # MiniCPM-V 4.5's official
        if key not in values and section.get(spelling) is not None:
            values[key] = section[spelling]
        if key in values:
            values[key] = tuple(float(v) for v in values[key])
    if values.get("image_grid_pinpoints"):
        values["image_grid_pinpoints"] = tuple((int(h), int(w)) for h, w in values["image_grid_pinpoints"])
    if isinstance(values.get("crop_size"), dict):
        values["crop_size"] = (int(values["crop_size"]["height"]), int(values["crop_size"]["width"]))
    if size.get("shortest_edge"):  # read as an edge by CLIP-style resize rules only (GLM's is a pixel count)
        values["shortest_edge"] = int(size["shortest_edge"])
    if size.get("height") and size.get("width"):
        values["resize_to"] = (int(size["height"]), int(size["width"]))
    return dataclasses.replace(base, min_pixels=int(min_pixels), max_pixels=int(max_pixels), **values)


def load_processor_sections(checkpoint: Path) -> tuple[dict, dict]:
    """(image section, video section) of a checkpoint's processor config, v5 nested layout
    (`processor_config.json`) or the older separate files. The processor's own scalar fields
    (LLaVA's `patch_size`, `vision_feature_select_strategy`, ...) are in the image section too,
    under the image processor's."""
    image = video = None
    processor: dict = {}
    nested = checkpoint / "processor_config.json"
    if nested.is_file():
        data = json.loads(nested.read_text(encoding="utf-8"))
        image, video = data.get("image_processor"), data.get("video_processor")
        processor = {key: value for key, value in data.items() if not isinstance(value, dict)}
    if image is None and (checkpoint / "preprocessor_config.json").is_file():
        image = json.loads((checkpoint / "preprocessor_config.json").read_text(encoding="utf-8"))
    if video is None and (checkpoint / "video_preprocessor_config.json").is_file():
        video = json.loads((checkpoint / "video_preprocessor_config.json").read_text(encoding="utf-8"))
    image = {**processor, **(image or {})}
    return image, (video if video is not None else dict(image))


@dataclass(frozen=True)
class RequestOptions:
    """A request's `mm_options` over the checkpoint's and the build's defaults."""
    image: VisionSettings
    video: VisionSettings
    sampling: VideoSampling
    video_pruning_rate: float = 0.0


class Preprocessor:
    """Turns one request (text, images, videos, mm_options) into the `preprocess` outputs."""

    def __init__(self, checkpoint: str | Path, limits: Limits = DEFAULT_LIMITS,
                 options: PreprocessOptions = PreprocessOptions()):
        from tokenizers import Tokenizer

        checkpoint = Path(checkpoint)
        self.family: Family = detect_family(checkpoint)
        self.config: dict = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
        self.limits = limits
        self.options = options
        check_pruning(self.family, options.video_pruning_rate, "video_pruning_rate")
        self.tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))

        image_section, video_section = load_processor_sections(checkpoint)
        self.image_settings = _settings(image_section, self.family.image_size_default, self.family)
        # The processor numbers videos by its image processor's `use_image_id` too.
        self.video_settings = dataclasses.replace(_settings(video_section, self.family.video_size_default, self.family),
                                                  **{"use_image_id": self.image_settings.use_image_id,
                                                     **self.family.video_settings})
        if self.image_settings.row_size != self.video_settings.row_size:
            raise ValueError(f"{checkpoint}: image and video patches differ in size")
        fps = video_section.get("fps") or None
        self.video_sampling = VideoSampling(
            fps=float(fps) if fps else (None if video_section.get("num_frames") else self.family.default_video_fps),
            num_frames=None if fps else video_section.get("num_frames"),
            min_frames=int(video_section.get("min_frames") or 4),
            max_frames=int(video_section.get("max_frames") or 768),
            cap_pixels_per_frame=bool(video_section.get("cap_pixels_per_frame")),
            max_video_tokens=int(video_section.get("max_video_tokens") or 128000),
            extra=tuple((key, video_section[key]) for key in self.family.video_sampler_keys
                        if video_section.get(key) is not None))

        named = self.family.named_special_tokens
        if self.family.placeholders_in_text:  # marks no tokenizer gives, where the text has a placeholder
            self.image_token_id, self.video_token_id = IMAGE_MARK, VIDEO_MARK
            self._placeholder_pattern = re.compile(
                "(" + "|".join(map(re.escape, (self.family.image_placeholder, self.family.video_placeholder))) + ")")
        else:
            self.image_token_id = self._token_id("image_token_id", named["image_token"])
            # A family that takes no videos may have no video token (LLaVA's tokenizers have none).
            self.video_token_id = (self._token_id("video_token_id", named["video_token"])
                                   if self.family.takes_videos else VIDEO_MARK)

    def warmup(self) -> None:
        """One small image and video through every stage, so no request pays for lazy imports."""
        from triton_vlm import samples

        video = self.family.takes_videos
        self(self.family.image_placeholder + self.family.video_placeholder * video, [samples.image_bytes(64, 64)],
             [samples.video_bytes(seconds=1.0, fps=4, width=64, height=64)] * video)

    def _token_id(self, config_key: str, token: str) -> int:
        value = self.config.get(config_key)
        return self._vocab_id(token) if value is None else int(value)

    def _vocab_id(self, token: str) -> int:
        value = self.tokenizer.token_to_id(token)
        if value is None:
            raise ValueError(f"checkpoint has no id for {token}")
        return value

    # ------------------------------------------------------------------------------ the request, step by step
    def __call__(self, text: str | bytes, images: list[bytes] | None = None, videos: list[bytes] | None = None,
                 mm_options: dict | str | bytes | None = None) -> PreprocessOutput:
        images, videos = list(images or []), list(videos or [])
        options = self._options(parse_mm_options(mm_options))
        if len(images) > 1 and self.family.several_images_settings:
            options = dataclasses.replace(
                options, image=dataclasses.replace(options.image, **self.family.several_images_settings))
        ids = self._prompt_ids(_text_input(text), len(images), len(videos))
        items = self._items(ids, self._item_bytes(images, videos))
        items = _map(lambda item: self._plan(item, options), items)
        self._check_frame_patches(items)
        expansions = self._expansions(ids, items, options.video_pruning_rate)
        pixel_values = self._pixels(items)
        return self._assemble(ids, items, expansions, pixel_values, options.video_pruning_rate)

    def _options(self, opts: dict) -> RequestOptions:
        """The request's options (keys and values checked, InvalidInput naming them) over the defaults."""
        unknown = sorted(str(k) for k in opts if k not in MM_OPTION_KEYS)
        if unknown:
            raise InvalidInput(f"mm_options: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(MM_OPTION_KEYS)}")
        opts = {k: v for k, v in opts.items() if v is not None}
        rate = self.options.video_pruning_rate
        if "video_pruning_rate" in opts:
            try:
                rate = check_pruning(self.family, opts.pop("video_pruning_rate"), "mm_options: video_pruning_rate")
            except ValueError as error:
                raise InvalidInput(str(error)) from None
        for key, value in opts.items():
            if key == "fps":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            if not ok:
                kind = "a positive number" if key == "fps" else "a positive integer"
                raise InvalidInput(f"mm_options: {key} must be {kind}")
        if "fps" in opts and "num_frames" in opts:
            raise InvalidInput("mm_options: fps and num_frames are mutually exclusive")
        sampled = [k for k in ("fps", "num_frames", "max_frames") if k in opts]
        if sampled and self.family.sample_frames is None and self.family.takes_videos:
            raise InvalidInput(f"mm_options: {', '.join(sampled)} does not apply: {self.family.name} takes every "
                               "frame of a video (its video processor samples none)")
        if "force_packing" in opts and self.family.pack_frames is None:
            raise InvalidInput(f"mm_options: force_packing does not apply: {self.family.name} does not pack video frames")
        limits = self.limits
        for key in ("min_pixels", "max_pixels"):
            if opts.get(key, 0) > limits.max_image_pixels:
                raise InvalidInput(f"mm_options: {key}={opts[key]} exceeds max_image_pixels={limits.max_image_pixels}")
        for key in ("num_frames", "max_frames"):
            if opts.get(key, 0) > limits.max_video_frames:
                raise InvalidInput(f"mm_options: {key}={opts[key]} exceeds max_frames={limits.max_video_frames}")

        sizes = {k: opts[k] for k in ("min_pixels", "max_pixels") if k in opts}
        sized_by = self.family.sized_by or (self.family.slice_rule is not None
                                            and "the checkpoint's scale_resolution and max_slice_nums")
        if sizes and sized_by:
            raise InvalidInput(f"mm_options: {', '.join(sizes)} does not apply: {self.family.name} sizes images "
                               f"by {sized_by}")
        # A max_pixels below min_pixels is what transformers takes too: smart_resize caps at
        # max_pixels first, so the smaller bound wins.
        image, video = self.image_settings, self.video_settings
        if sizes:
            image = dataclasses.replace(image, **sizes)
            video = dataclasses.replace(video, **sizes)
        sampling = self.video_sampling
        if "num_frames" in opts:
            sampling = dataclasses.replace(sampling, fps=None, num_frames=opts["num_frames"])
        elif "fps" in opts:
            sampling = dataclasses.replace(sampling, fps=float(opts["fps"]), num_frames=None)
        if "max_frames" in opts:
            sampling = dataclasses.replace(sampling, max_frames=opts["max_frames"])
        if "force_packing" in opts:
            sampling = dataclasses.replace(sampling, force_packing=opts["force_packing"])
        return RequestOptions(image, video, sampling, rate)

    def _encode(self, text: str) -> np.ndarray:
        if not self.family.placeholders_in_text:
            return np.asarray(self.tokenizer.encode(text).ids, dtype=np.int32)
        marks = {self.family.image_placeholder: IMAGE_MARK, self.family.video_placeholder: VIDEO_MARK}
        pieces = self._placeholder_pattern.split(text)  # text, placeholder, text, ...
        texts = self._encode_pieces(pieces[::2])
        ids = [*texts[0]]
        for placeholder, following in zip(pieces[1::2], texts[1:]):
            ids += [marks[placeholder], *following]
        return np.asarray(ids, dtype=np.int32)

    def _encode_pieces(self, texts: list[str]) -> list[list[int]]:
        """Ids of text pieces spliced between special tokens (no special tokens added)."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def _prompt_ids(self, text: str, n_images: int, n_videos: int) -> np.ndarray:
        """The prompt's ids, one placeholder per item (put before the text if it holds none)."""
        if n_videos and not self.family.takes_videos:
            raise InvalidInput(f"videos: this model ({self.family.name}) takes no videos in this version of triton-vlm")
        if n_images + n_videos > self.limits.max_media_items:
            raise InvalidInput(f"images, videos: {n_images + n_videos} media items exceed "
                               f"max_media_items={self.limits.max_media_items}")
        ids = self._encode(text)
        if ids.shape[0] == 0 and not n_images + n_videos:
            raise InvalidInput("text_input: the prompt is empty")
        if not self._placeholders(ids).any() and n_images + n_videos:
            ids = self._encode(self.family.image_placeholder * n_images + self.family.video_placeholder * n_videos
                               + text)
        for kind, token, given in (("image", self.image_token_id, n_images), ("video", self.video_token_id, n_videos)):
            found = int((ids == token).sum())
            if found != given:
                raise InvalidInput(f"text_input: {found} {kind} placeholders but {given} {kind}s given")
        if ids.shape[0] > self.limits.max_prompt_tokens:
            raise InvalidInput(f"text_input: prompt is {ids.shape[0]} tokens, exceeds "
                               f"max_prompt_tokens={self.limits.max_prompt_tokens}")
        return ids

    def _placeholders(self, ids: np.ndarray) -> np.ndarray:
        """bool mask of the image and video placeholder tokens of `ids`."""
        return np.isin(ids, (self.image_token_id, self.video_token_id))

    def _item_bytes(self, images: list, videos: list) -> dict[str, bytes]:
        """Every item's file bytes by name (cheap), the request's total checked before decoding."""
        encoded, request_bytes, limits = {}, 0, self.limits
        for kind, items_of_kind in (("images", images), ("videos", videos)):
            for i, raw in enumerate(items_of_kind):
                data = decode_item_bytes(raw, f"{kind}[{i}]", limits)
                request_bytes += len(data)
                if request_bytes > limits.max_request_bytes:
                    raise InvalidInput(f"images, videos: {request_bytes} bytes in all exceed "
                                       f"max_request_bytes={limits.max_request_bytes}")
                encoded[f"{kind}[{i}]"] = data
        return encoded

    def _items(self, ids: np.ndarray, encoded: dict[str, bytes]) -> list[_Item]:
        """The media items in prompt order."""
        items, counters = [], {"images": 0, "videos": 0}
        for token in ids[self._placeholders(ids)].tolist():
            kind = "videos" if token == self.video_token_id else "images"
            name = f"{kind}[{counters[kind]}]"
            items.append(_Item(name, encoded[name], index=counters[kind], video=kind == "videos"))
            counters[kind] += 1
        return items

    def _layout(self, height: int, width: int, settings: VisionSettings, name: str, num_frames: int) -> FrameLayout:
        """The family's views of an item's frames: its `slice_rule`, else one `resize_rule` size."""
        if self.family.slice_rule is not None:
            views = self.family.slice_rule(height, width, settings, name)
            packing = (num_frames * sum(v.rows * v.cols for v in views),) if self.family.pack_views else ()
            return FrameLayout(views, per_frame=True, packing=packing)
        size = target_size(height, width, settings, name, num_frames, self.family.resize_rule)
        return FrameLayout((View(size, crop=settings.center_crop),))

    def _plan(self, item: _Item, options: RequestOptions) -> _Item:
        """Phase 1 (items in parallel threads: Pillow, PyAV and torch release the GIL): the planned
        item, its size and grid from headers where they tell (JPEG images, H.264 videos: nothing
        decoded yet), else by decoding and resizing."""
        planned = self._plan_video(item, options) if item.video else self._plan_image(item, options.image)
        return dataclasses.replace(planned, grids=planned.layout.grids(planned.num_frames, planned.settings))

    def _plan_image(self, item: _Item, settings: VisionSettings) -> _Item:
        decoded: list[np.ndarray] = []  # the image's uint8 frames [1, H, W, 3], once something decodes them

        def pixels() -> np.ndarray:
            if not decoded:
                decoded.append(decode_image(item.data, item.name, self.limits)[None])
            return decoded[0]

        probed = probe_image(item.data, item.name, self.limits) or pixels().shape[1:3]
        layout = self._layout(probed[0], probed[1], settings, item.name, 1)
        if self.family.refine_layout is not None:
            layout = self.family.refine_layout(layout, settings, lambda: pixels()[0], item.name)
        return dataclasses.replace(item, settings=settings, layout=layout, probed=tuple(probed),
                                   frames=layout.resize(decoded[0], settings) if decoded else None)

    def _check_frame_patches(self, items: list[_Item]) -> None:
        """No frame (no packed group of frames, which the tower takes whole) larger than one
        encoder run takes (`max_frame_patches`)."""
        limit = self.limits.max_frame_patches
        for item in items:
            packed = item.temporal_ids is not None
            frame = max(((t if packed else 1) * h * w for t, h, w in item.grids), default=0)
            if frame > limit:
                unit = "packed group of frames" if packed else "frame"
                raise InvalidInput(f"{item.name}: {frame} patches per {unit} exceed max_frame_patches={limit}")

    def _plan_video(self, item: _Item, options: RequestOptions) -> _Item:
        name, sampling = item.name, options.sampling
        sampler = _bind_sampler(self.family.sample_frames, sampling, options.video)
        chosen: dict[str, Any] = {}  # settings, layout and temporal ids, once the frames are sampled

        def layout(meta) -> FrameLayout:
            n = len(meta.frames_indices)
            settings = _frame_settings(options.video, sampling, n)
            frame_layout, temporal_ids = self._layout(meta.height, meta.width, settings, name, n), None
            if self.family.pack_frames is not None:
                try:
                    temporal_ids = self.family.pack_frames(meta, fps=sampling.fps, force_packing=sampling.force_packing)
                except InvalidInput as error:
                    raise InvalidInput(f"{name}: {error}") from None
                frame_layout = dataclasses.replace(frame_layout, packing=tuple(len(g) for g in temporal_ids))
            chosen.update(settings=settings, layout=frame_layout, temporal_ids=temporal_ids)
            return frame_layout

        video_file = demux_video(item.data, name, self.limits)
        planned, frames = video_file.plan(sampler), None
        if planned is not None:
            meta = planned.meta
            layout(meta)
        else:
            frames, meta = video_file.decode(
                sampler, lambda meta: (layout(meta).stored, lambda f: chosen["layout"].resize(f, chosen["settings"])))
        second_per_grid_ts = chosen["settings"].temporal_patch_size / meta.sampled_fps
        t_factor = self.family.video_t_factor(self.config, second_per_grid_ts) if self.family.video_t_factor else 1.0
        return dataclasses.replace(item, **chosen, video_file=video_file, planned=planned, frames=frames,
                                   num_frames=len(meta.frames_indices), t_factor=t_factor, timestamps=meta.timestamps)

    def _expansions(self, ids: np.ndarray, items: list[_Item], rate: float) -> list[tuple[np.ndarray, list[MediaSpan]]]:
        """What each placeholder token becomes (media tokens, and for some families per-frame
        markers and timestamps), known from the grids alone: the prompt's real length is checked
        before anything is decoded into the output."""
        expansions = []
        for item in items:
            media = MediaLayout(video=item.video, index=item.index,
                                token=self.video_token_id if item.video else self.image_token_id,
                                grids=item.grids, views=item.layout.views, num_frames=item.num_frames,
                                settings=item.settings, timestamps=item.timestamps, t_factor=item.t_factor,
                                pruning_rate=rate if item.video else 0.0, source=item.probed)
            expansions.append(self.family.expand_media(media, self._vocab_id, self._encode_pieces))
        n_tokens = int(ids.shape[0]) - len(items) + sum(int(e.shape[0]) for e, _ in expansions)
        if n_tokens > self.limits.max_prompt_tokens:
            raise InvalidInput(f"text_input: prompt is {n_tokens} tokens after expanding media, exceeds "
                               f"max_prompt_tokens={self.limits.max_prompt_tokens}")
        return expansions

    def _pixels(self, items: list[_Item]) -> np.ndarray:
        """Phase 2, once the output buffer exists: the rest is decoded and written straight into it,
        video frames a temporal patch at a time as their GOPs finish decoding."""
        rows = np.array([sum(t * h * w for t, h, w in item.grids) for item in items], dtype=np.int64)
        pixel_values = np.empty((int(rows.sum()), self.image_settings.row_size), dtype=np.float32)
        starts = offsets(rows)
        _map(lambda i: _fill(items[i], pixel_values[starts[i]:starts[i + 1]], self.limits), range(len(items)))
        return pixel_values

    def _assemble(self, ids: np.ndarray, items: list[_Item], expansions: list, pixel_values: np.ndarray,
                  rate: float) -> PreprocessOutput:
        """The expanded prompt, its grids and positions (the reference's pruned rule when rate > 0)."""
        pieces, spans, previous, length = [], [], 0, 0
        for position, (expanded, item_spans) in zip(np.flatnonzero(self._placeholders(ids)).tolist(), expansions):
            pieces += [ids[previous:position], expanded]
            length += position - previous
            spans += [dataclasses.replace(span, offset=span.offset + length) for span in item_spans]
            length += expanded.shape[0]
            previous = position + 1
        pieces.append(ids[previous:])
        input_ids = np.concatenate(pieces).astype(np.int32, copy=False)
        grids = np.array([g for item in items for g in item.grids], dtype=np.int64).reshape(-1, 3)
        temporal_ids = np.concatenate([_frame_temporal_ids(item) for item in items] + [np.zeros(0, np.int64)])
        image_sizes = np.array([(item.probed if self.family.image_sizes and item.probed else (0, 0))
                                for item in items for _ in item.grids], dtype=np.int64).reshape(-1, 2)
        if self.family.prompt_positions is not None:
            kinds = np.select([input_ids == self.image_token_id, input_ids == self.video_token_id], [1, 2], 0)
            positions, delta = self.family.prompt_positions(input_ids, kinds, grids, self.config)
            media = np.zeros((3, 0), np.int64)
        elif rate > 0:
            positions, delta, media = pruned_mrope_positions(input_ids.shape[0], spans)
        else:
            (positions, delta), media = mrope_positions(input_ids.shape[0], spans), np.zeros((3, 0), np.int64)
        return PreprocessOutput(input_ids=input_ids, pixel_values=pixel_values, grid_thw=grids,
                                mrope_position_ids=positions, mrope_position_delta=delta,
                                media_position_ids=media, video_pruning_rate=rate, temporal_ids=temporal_ids,
                                image_sizes=image_sizes)


def _text_input(text: str | bytes) -> str:
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput("text_input: not valid UTF-8") from None
    if not isinstance(text, str):
        raise InvalidInput("text_input: expected a string")
    return text


@dataclass(frozen=True)
class _Item:
    """One media item of a request: as the prompt names it (`_items`: name, bytes, index, kind),
    then planned (`_plan`, phase 1 of `Preprocessor.__call__`: a new item with its settings, views
    and grid rows, and what phase 2, `_fill`, still has to decode)."""
    name: str
    data: bytes
    index: int = 0                      # among the request's items of its kind
    video: bool = False
    settings: VisionSettings | None = None
    layout: FrameLayout | None = None
    num_frames: int = 1
    grids: list[tuple[int, int, int]] = field(default_factory=list)  # its grid_thw rows
    t_factor: float = 1.0
    timestamps: np.ndarray | None = None  # a video's sampled frames, in seconds
    frames: np.ndarray | None = None    # resized uint8 frames, when phase 1 had to decode
    video_file: DemuxedVideo | None = None  # a video, demuxed once
    planned: PlannedVideo | None = None  # an H.264 video whose frames phase 2 decodes
    probed: tuple[int, int] | None = None
    temporal_ids: list[list[int]] | None = None  # a packed video's, per group (`Family.pack_frames`)


def _frame_temporal_ids(item: _Item) -> np.ndarray:
    """int64, one per frame of the item's grid rows: its packed groups' temporal ids, else -1."""
    if item.temporal_ids is not None:
        return np.array([i for group in item.temporal_ids for i in group], dtype=np.int64)
    return np.full(sum(t for t, _, _ in item.grids), -1, dtype=np.int64)


def _fill(item: _Item, out: np.ndarray, limits: Limits) -> None:
    """Phase 2: decode what is left of `item` and write its pixel rows into `out`."""
    settings, layout, frames = item.settings, item.layout, item.frames
    if frames is None and item.planned is None:  # an image known from its header
        decoded = decode_image(item.data, item.name, limits)[None]
        if tuple(decoded.shape[1:3]) != item.probed:
            raise not_decodable_image(item.name, item.data, f"decoded to {decoded.shape[1:3]}, header said {item.probed}")
        frames = layout.resize(decoded, settings)
    if frames is not None:
        layout.write(frames, settings, out)
        return
    meta, tps = item.planned.meta, settings.temporal_patch_size
    n = len(meta.frames_indices)
    staging = np.empty((n, *layout.stored, 3), dtype=np.uint8)
    n_patches = -(-n // tps)
    rows_per_patch = out.shape[0] // n_patches
    pending = [min(tps, n - g * tps) for g in range(n_patches)]  # frames missing per temporal patch
    lock = threading.Lock()

    def store(k: int, frame) -> None:
        staging[k] = layout.resize(frame_rgb(frame, meta.width, meta.height)[None], settings)[0]
        g = k // tps
        with lock:
            pending[g] -= 1
            ready = pending[g] == 0
        if ready:
            layout.write(staging[g * tps:min(n, (g + 1) * tps)], settings,
                         out[g * rows_per_patch:(g + 1) * rows_per_patch])

    if not item.planned.decode(store):
        # The fast path could not vouch for its frames: decode everything (from the packets
        # already demuxed), which must agree.
        frames, _ = item.video_file.decode(lambda _meta: meta.frames_indices,
                                           lambda _m: (layout.stored, lambda f: layout.resize(f, settings)))
        if frames.shape[0] != n:
            raise InvalidInput(f"{item.name}: not a decodable video")
        layout.write(frames, settings, out)


def _map(fn, args) -> list:
    """`[fn(a) for a in args]`, in threads when there are several (the work releases the GIL).
    The first failure (an `InvalidInput` naming its item, in prompt order) is raised."""
    args = list(args)
    workers = min(len(args), os.cpu_count() or 1)
    if workers <= 1:
        return [fn(a) for a in args]
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(fn, a) for a in args]
        return [f.result() for f in futures]


def _bind_sampler(sample_frames, sampling: VideoSampling, settings: VisionSettings):
    """The family's frame sampler with this request's options."""
    if sample_frames is None:
        return lambda meta: np.arange(meta.total_num_frames)
    return partial(sample_frames, fps=sampling.fps, num_frames=sampling.num_frames,
                   min_frames=sampling.min_frames, max_frames=sampling.max_frames,
                   temporal_patch_size=settings.temporal_patch_size, **dict(sampling.extra))


def _frame_settings(settings: VisionSettings, sampling: VideoSampling, num_frames: int) -> VisionSettings:
    """The video settings for `num_frames` frames: with transformers' `cap_pixels_per_frame`, each
    frame gets an even share of the video's pixel budget."""
    if not sampling.cap_pixels_per_frame:
        return settings
    factor = settings.factor
    total_pixels = int(sampling.max_video_tokens * factor * factor * 0.9)
    max_pixels = max(min(settings.max_pixels, total_pixels * settings.temporal_patch_size // num_frames),
                     int(settings.min_pixels * 1.05))
    return dataclasses.replace(settings, max_pixels=max_pixels)
