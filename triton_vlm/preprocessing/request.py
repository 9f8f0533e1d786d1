"""A request's options: the checkpoint's processor config (`load_processor_sections`,
`vision_settings`) under the family's rules and the build's limits as `Defaults`, and a request's
`mm_options` over them (`Defaults.request`: every key and value checked, InvalidInput naming it).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_vlm.contract.limits import Limits
from triton_vlm.errors import InvalidInput
from triton_vlm.families.base import Family, ProcessorRules
from triton_vlm.media.sizing import VisionSettings

# Boolean options: `VisionSettings` fields of the images, honoured by the families that list them
# (`ProcessorRules.image_flags`).
MM_OPTION_FLAGS = ("do_pan_and_scan",)
MM_OPTION_KEYS = ("min_pixels", "max_pixels", "fps", "num_frames", "max_frames", "force_packing",
                  "video_pruning_rate") + MM_OPTION_FLAGS


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


def vision_settings(section: dict, size_default: tuple[int, int], rules: ProcessorRules) -> VisionSettings:
    """The `VisionSettings` of a processor config section; what it leaves out, its processor class's
    defaults (the family's `vision_defaults`, and `processor_defaults` by the section's class)."""
    processor_class = section.get("image_processor_type") or section.get("video_processor_type")
    defaults = {**rules.vision_defaults, **rules.processor_defaults.get(processor_class, {})}
    size = section.get("size") or {}
    min_pixels = section.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or size_default[0]
    max_pixels = section.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or size_default[1]
    base = VisionSettings(**defaults)
    values = {f.name: section[f.name] for f in dataclasses.fields(VisionSettings)
              if section.get(f.name) is not None and f.name not in ("min_pixels", "max_pixels")}
    for key, spelling in (("image_mean", "norm_mean"), ("image_std", "norm_std")):  # official remote code's
        if key not in values and section.get(spelling) is not None:
            values[key] = section[spelling]
        if key in values:
            values[key] = tuple(float(v) for v in values[key])
    if values.get("image_grid_pinpoints"):
        values["image_grid_pinpoints"] = tuple((int(h), int(w)) for h, w in values["image_grid_pinpoints"])
    if isinstance(values.get("crop_size"), dict):
        values["crop_size"] = (int(values["crop_size"]["height"]), int(values["crop_size"]["width"]))
    if size.get("shortest_edge"):  # read as an edge by CLIP-style resize rules only (others read it as a pixel count)
        values["shortest_edge"] = int(size["shortest_edge"])
    if size.get("height") and size.get("width"):
        values["resize_to"] = (int(size["height"]), int(size["width"]))
    values.update(rules.processor_settings)
    return dataclasses.replace(base, min_pixels=int(min_pixels), max_pixels=int(max_pixels), **values)


def load_processor_sections(checkpoint: Path) -> tuple[dict, dict]:
    """(image section, video section) of a checkpoint's processor config, v5 nested layout
    (`processor_config.json`) or the older separate files. The processor's own scalar fields
    (`patch_size`, `vision_feature_select_strategy`, ...) are in the image section too,
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


@dataclass(frozen=True)
class Defaults:
    """What every request's options start from: the checkpoint's processor config under the
    family's rules, the build's limits and EVS pruning rate (`read`); `request` puts a request's
    `mm_options` over them."""
    family: Family
    limits: Limits
    image: VisionSettings
    video: VisionSettings
    sampling: VideoSampling
    video_pruning_rate: float = 0.0

    @classmethod
    def read(cls, checkpoint: Path, family: Family, limits: Limits, video_pruning_rate: float) -> Defaults:
        rules = family.processor
        image_section, video_section = load_processor_sections(checkpoint)
        if rules.config_settings:
            config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
            from_config = {name: config[key] for name, key in rules.config_settings.items() if key in config}
            image_section, video_section = {**from_config, **image_section}, {**from_config, **video_section}
        image = vision_settings(image_section, rules.image_size_default, rules)
        # The processor numbers videos by its image processor's `use_image_id` too.
        video = dataclasses.replace(vision_settings(video_section, rules.video_size_default, rules),
                                    **{"use_image_id": image.use_image_id, **rules.video_settings})
        if image.row_size != video.row_size:
            raise ValueError(f"{checkpoint}: image and video patches differ in size")
        fps, num_frames = video_section.get("fps") or None, video_section.get("num_frames")
        if rules.default_video_fps is None and not video_section.get("do_sample_frames"):
            fps = num_frames = None  # a processor without a rate of its own samples only when told to
        sampling = VideoSampling(
            fps=float(fps) if fps else (None if num_frames else rules.default_video_fps),
            num_frames=None if fps else num_frames,
            min_frames=int(video_section.get("min_frames") or 4),
            max_frames=int(video_section.get("max_frames") or 768),
            cap_pixels_per_frame=bool(video_section.get("cap_pixels_per_frame")),
            max_video_tokens=int(video_section.get("max_video_tokens") or rules.max_video_tokens),
            extra=tuple((key, video_section[key]) for key in rules.video_sampler_keys
                        if video_section.get(key) is not None))
        return cls(family, limits, image, video, sampling, family.pruning_rate(video_pruning_rate, "video_pruning_rate"))

    def request(self, opts: dict, images: int) -> RequestOptions:
        """A request's options (keys and values checked, InvalidInput naming them) over these, for a
        request of `images` images."""
        unknown = sorted(str(k) for k in opts if k not in MM_OPTION_KEYS)
        if unknown:
            raise InvalidInput(f"mm_options: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(MM_OPTION_KEYS)}")
        opts = {k: v for k, v in opts.items() if v is not None}
        rate = self.video_pruning_rate
        if "video_pruning_rate" in opts:
            try:
                rate = self.family.pruning_rate(opts.pop("video_pruning_rate"), "mm_options: video_pruning_rate")
            except ValueError as error:
                raise InvalidInput(str(error)) from None
        flags = {k: opts.pop(k) for k in MM_OPTION_FLAGS if k in opts}
        for key, value in flags.items():
            if not isinstance(value, bool):
                raise InvalidInput(f"mm_options: {key} must be a boolean (true or false)")
            if key not in self.family.processor.image_flags:
                raise InvalidInput(f"mm_options: {key} does not apply: {self.family.name}'s processor has no {key}")
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
        if sampled and self.family.processor.sample_frames is None and self.family.processor.takes_videos:
            raise InvalidInput(f"mm_options: {', '.join(sampled)} does not apply: {self.family.name} takes every "
                               "frame of a video (its video processor samples none)")
        if "force_packing" in opts and self.family.processor.pack_frames is None:
            raise InvalidInput(f"mm_options: force_packing does not apply: {self.family.name} does not pack video frames")
        limits = self.limits
        for key in ("min_pixels", "max_pixels"):
            if opts.get(key, 0) > limits.max_image_pixels:
                raise InvalidInput(f"mm_options: {key}={opts[key]} exceeds max_image_pixels={limits.max_image_pixels}")
        for key in ("num_frames", "max_frames"):
            if opts.get(key, 0) > limits.max_video_frames:
                raise InvalidInput(f"mm_options: {key}={opts[key]} exceeds max_frames={limits.max_video_frames}")

        sizes = {k: opts[k] for k in ("min_pixels", "max_pixels") if k in opts}
        sized_by = self.family.processor.sized_by or (self.family.processor.slice_rule is not None
                                            and "the checkpoint's scale_resolution and max_slice_nums")
        if sizes and sized_by:
            raise InvalidInput(f"mm_options: {', '.join(sizes)} does not apply: {self.family.name} sizes images "
                               f"by {sized_by}")
        # A max_pixels below min_pixels is what transformers takes too: smart_resize caps at
        # max_pixels first, so the smaller bound wins.
        image, video = self.image, self.video
        if sizes:
            image = dataclasses.replace(image, **sizes)
            video = dataclasses.replace(video, **sizes)
        sampling = self.sampling
        if "num_frames" in opts:
            sampling = dataclasses.replace(sampling, fps=None, num_frames=opts["num_frames"])
        elif "fps" in opts:
            sampling = dataclasses.replace(sampling, fps=float(opts["fps"]), num_frames=None)
        if "max_frames" in opts:
            if sampling.fps is None and sampling.num_frames is None:
                raise InvalidInput(f"mm_options: max_frames does not apply: {self.family.name} takes every frame "
                                   "of a video unless fps or num_frames is given")
            sampling = dataclasses.replace(sampling, max_frames=opts["max_frames"])
        if "force_packing" in opts:
            sampling = dataclasses.replace(sampling, force_packing=opts["force_packing"])
        if flags:
            image = dataclasses.replace(image, **flags)
        if images > 1 and self.family.processor.several_images_settings:
            image = dataclasses.replace(image, **self.family.processor.several_images_settings)
        return RequestOptions(image, video, sampling, rate)
