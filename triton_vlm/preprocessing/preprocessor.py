"""The `preprocess` step: prompt text + encoded media -> input_ids, pixel_values, grid_thw, M-RoPE.

Built once per checkpoint from its own files (config.json, processor_config.json or the older
preprocessor_config.json, tokenizer.json); each call is one request. Family rules come from the
`Family` that `detect_family` returns; nothing here branches on a family's name.

Outputs equal the Hugging Face processor's (`input_ids`, `pixel_values` / `pixel_values_videos`
rows in prompt order, `image_grid_thw` / `video_grid_thw` rows in prompt order); positions follow
the reference rule (see `triton_vlm.media.mrope`). A request's options are `request`'s, its media
items `items`'.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from triton_vlm.contract.limits import DEFAULT_LIMITS, Limits
from triton_vlm.contract.messages import PreprocessOutput
from triton_vlm.contract.params import PreprocessOptions
from triton_vlm.contract.tensors import EXTRAS
from triton_vlm.errors import InvalidInput
from triton_vlm.families import detect_family
from triton_vlm.families.base import Family, MediaLayout
from triton_vlm.media.frames import FrameLayout, View
from triton_vlm.media.images import decode_image, decode_item_bytes, probe_image
from triton_vlm.media.mrope import MediaSpan, mrope_positions, pruned_mrope_positions
from triton_vlm.media.sizing import VisionSettings, target_size
from triton_vlm.media.videos import demux_video
from triton_vlm.preprocessing.items import Item, bind_sampler, fill, frame_settings, item_extras, map_items
from triton_vlm.preprocessing.request import Defaults, RequestOptions, parse_mm_options
from triton_vlm.tokenizer import load_tokenizer

# Where a family's placeholders are text (`Family.placeholders_in_text`), the ids that stand for
# one in the prompt until it is expanded: no tokenizer gives a negative id.
IMAGE_MARK, VIDEO_MARK = -1, -2


class Preprocessor:
    """Turns one request (text, images, videos, mm_options) into the `preprocess` outputs."""

    def __init__(self, checkpoint: str | Path, limits: Limits = DEFAULT_LIMITS,
                 options: PreprocessOptions = PreprocessOptions()):
        checkpoint = Path(checkpoint)
        self.family: Family = detect_family(checkpoint)
        self.config: dict = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
        self.limits = limits
        self.tokenizer = load_tokenizer(checkpoint)

        self.defaults = Defaults.read(checkpoint, self.family, limits, options.video_pruning_rate)
        self.image_settings, self.video_settings = self.defaults.image, self.defaults.video
        self.video_sampling = self.defaults.sampling

        named = self.family.prompt.named_special_tokens
        if self.family.prompt.placeholders_in_text:  # marks no tokenizer gives, where the text has a placeholder
            self.image_token_id, self.video_token_id = IMAGE_MARK, VIDEO_MARK
            videos = self.family.processor.takes_videos
            placeholders = (self.family.image_placeholder,) + (self.family.video_placeholder,) * videos
            self._placeholder_pattern = re.compile("(" + "|".join(map(re.escape, placeholders)) + ")")
            self._special_around = _special_tokens_around(self.tokenizer)
        else:
            name, key = self.family.prompt.image_placeholder_token
            self.image_token_id = self._token_id(key, named[name])
            # A family that takes no videos may have no video token in its tokenizer.
            self.video_token_id = (self._token_id("video_token_id", named["video_token"])
                                   if self.family.processor.takes_videos else VIDEO_MARK)

    def warmup(self) -> None:
        """One small image and video through every stage, so no request pays for lazy imports."""
        from triton_vlm.media import samples

        video = self.family.processor.takes_videos
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
        options = self.defaults.request(parse_mm_options(mm_options), len(images))
        text = _text_input(text)
        ids = self._prompt_ids(text, len(images), len(videos))
        items = self._items(ids, self._item_bytes(images, videos))
        items = map_items(lambda item: self._plan(item, options), items)
        self._check_frame_patches(items)
        if self.family.processor.expand_text is not None:
            ids, expansions = self._text_expanded(text, items), []
        else:
            expansions = self._expansions(ids, items, options.video_pruning_rate)
        pixel_values = self._pixels(items)
        return self._assemble(ids, items, expansions, pixel_values, options.video_pruning_rate)

    def _encode(self, text: str) -> np.ndarray:
        prefix, video = self.family.prompt.video_prefix, self.family.video_placeholder
        if prefix:
            text = text.replace(video, prefix + video)
        if not self.family.prompt.placeholders_in_text:
            return np.asarray(self.tokenizer.encode(text).ids, dtype=np.int32)
        marks = {self.family.image_placeholder: IMAGE_MARK, self.family.video_placeholder: VIDEO_MARK}
        pieces = self._placeholder_pattern.split(text)  # text, placeholder, text, ...
        texts = self._encode_pieces(pieces[::2])
        before, after = self._special_around
        ids = [*before, *texts[0]]
        for placeholder, following in zip(pieces[1::2], texts[1:]):
            ids += [marks[placeholder], *following]
        return np.asarray(ids + after, dtype=np.int32)

    def _encode_pieces(self, texts: list[str]) -> list[list[int]]:
        """Ids of text pieces spliced between special tokens (no special tokens added)."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def _prompt_ids(self, text: str, n_images: int, n_videos: int) -> np.ndarray:
        """The prompt's ids, one placeholder per item (put before the text if it holds none)."""
        if n_videos and not self.family.processor.takes_videos:
            raise InvalidInput(f"videos: this model ({self.family.name}) takes no videos in this version of triton-vlm")
        if self.family.processor.max_images and n_images > self.family.processor.max_images:
            raise InvalidInput(f"images: {n_images} images exceed this model's {self.family.processor.max_images} "
                               f"per prompt ({self.family.name})")
        if n_images + n_videos > self.limits.max_media_items:
            raise InvalidInput(f"images, videos: {n_images + n_videos} media items exceed "
                               f"max_media_items={self.limits.max_media_items}")
        ids = self._encode(text)
        if (ids.shape[0] == 0 or not text) and not n_images + n_videos:  # (a tokenizer may add `<s>` to nothing)
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

    def _items(self, ids: np.ndarray, encoded: dict[str, bytes]) -> list[Item]:
        """The media items in prompt order."""
        items, counters = [], {"images": 0, "videos": 0}
        for token in ids[self._placeholders(ids)].tolist():
            kind = "videos" if token == self.video_token_id else "images"
            name = f"{kind}[{counters[kind]}]"
            items.append(Item(name, encoded[name], index=counters[kind], video=kind == "videos"))
            counters[kind] += 1
        return items

    def _layout(self, height: int, width: int, settings: VisionSettings, name: str, num_frames: int) -> FrameLayout:
        """The family's views of an item's frames: its `slice_rule`, else one `resize_rule` size."""
        if self.family.processor.slice_rule is not None:
            views = self.family.processor.slice_rule(height, width, settings, name)
            packing = (num_frames * sum(v.rows * v.cols for v in views),) if self.family.processor.pack_views else ()
            return FrameLayout(views, per_frame=True, packing=packing)
        size = target_size(height, width, settings, name, num_frames, self.family.processor.resize_rule)
        return FrameLayout((View(size, crop=settings.center_crop),))

    def _plan(self, item: Item, options: RequestOptions) -> Item:
        """Phase 1 (items in parallel threads: Pillow, PyAV and torch release the GIL): the planned
        item, its size and grid from headers where they tell (JPEG images, H.264 videos: nothing
        decoded yet), else by decoding and resizing."""
        planned = self._plan_video(item, options) if item.video else self._plan_image(item, options.image)
        return dataclasses.replace(planned, grids=planned.layout.grids(planned.num_frames, planned.settings))

    def _plan_image(self, item: Item, settings: VisionSettings) -> Item:
        decoded: list[np.ndarray] = []  # the image's uint8 frames [1, H, W, 3], once something decodes them

        def pixels() -> np.ndarray:
            if not decoded:
                decoded.append(decode_image(item.data, item.name, self.limits)[None])
            return decoded[0]

        probed = probe_image(item.data, item.name, self.limits) or pixels().shape[1:3]
        layout = self._layout(probed[0], probed[1], settings, item.name, 1)
        if self.family.processor.refine_layout is not None:
            layout = self.family.processor.refine_layout(layout, settings, lambda: pixels()[0], item.name)
        return dataclasses.replace(item, settings=settings, layout=layout, probed=tuple(probed),
                                   frames=layout.resize(decoded[0], settings) if decoded else None)

    def _check_frame_patches(self, items: list[Item]) -> None:
        """No frame (no packed group of frames, which the tower takes whole) larger than one
        encoder run takes (`max_frame_patches`)."""
        limit = self.limits.max_frame_patches
        for item in items:
            packed = item.temporal_ids is not None
            frame = max(((t if packed else 1) * h * w for t, h, w in item.grids), default=0)
            if frame > limit:
                unit = "packed group of frames" if packed else "frame"
                raise InvalidInput(f"{item.name}: {frame} patches per {unit} exceed max_frame_patches={limit}")

    def _plan_video(self, item: Item, options: RequestOptions) -> Item:
        name, sampling = item.name, options.sampling
        sampler = bind_sampler(self.family.processor.sample_frames, sampling, options.video)
        chosen: dict[str, Any] = {}  # settings, layout and temporal ids, once the frames are sampled

        def layout(meta) -> FrameLayout:
            n = len(meta.frames_indices)
            settings = frame_settings(options.video, sampling, n, self.family.processor.video_cap)
            frame_layout, temporal_ids = self._layout(meta.height, meta.width, settings, name, n), None
            if self.family.processor.pack_frames is not None:
                try:
                    temporal_ids = self.family.processor.pack_frames(meta, fps=sampling.fps,
                                                                     force_packing=sampling.force_packing)
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
        t_factor = self.family.processor.video_t_factor
        t_factor = t_factor(self.config, second_per_grid_ts) if t_factor else 1.0
        return dataclasses.replace(item, **chosen, video_file=video_file, planned=planned, frames=frames,
                                   num_frames=len(meta.frames_indices), t_factor=t_factor, timestamps=meta.timestamps)

    def _media_layout(self, item: Item, rate: float) -> MediaLayout:
        """What the family's expansion sees of a planned item (`rate`: the request's EVS pruning)."""
        return MediaLayout(video=item.video, index=item.index,
                           token=self.video_token_id if item.video else self.image_token_id,
                           grids=item.grids, views=item.layout.views, num_frames=item.num_frames,
                           settings=item.settings, timestamps=item.timestamps, t_factor=item.t_factor,
                           pruning_rate=rate if item.video else 0.0, source=item.probed)

    def _expansions(self, ids: np.ndarray, items: list[Item], rate: float) -> list[tuple[np.ndarray, list[MediaSpan]]]:
        """What each placeholder token becomes (media tokens, and for some families per-frame
        markers and timestamps), known from the grids alone: the prompt's real length is checked
        before anything is decoded into the output."""
        expansions = [self.family.processor.expand_media(self._media_layout(item, rate), self._vocab_id,
                                                         self._encode_pieces) for item in items]
        n_tokens = int(ids.shape[0]) - len(items) + sum(int(e.shape[0]) for e, _ in expansions)
        if n_tokens > self.limits.max_prompt_tokens:
            raise InvalidInput(f"text_input: prompt is {n_tokens} tokens after expanding media, exceeds "
                               f"max_prompt_tokens={self.limits.max_prompt_tokens}")
        return expansions

    def _text_expanded(self, text: str, items: list[Item]) -> np.ndarray:
        """The prompt's ids where each image placeholder is first replaced in the text by what the
        family's `expand_text` makes of it (put before the text if it holds none), then encoded whole."""
        placeholder = self.family.image_placeholder
        if placeholder not in text:
            text = placeholder * len(items) + text
        pieces = text.split(placeholder)
        expanded = [pieces[0]]
        for item, following in zip(items, pieces[1:]):
            expanded += [self.family.processor.expand_text(self._media_layout(item, 0.0)), following]
        ids = np.asarray(self.tokenizer.encode("".join(expanded)).ids, dtype=np.int32)
        if ids.shape[0] > self.limits.max_prompt_tokens:
            raise InvalidInput(f"text_input: prompt is {ids.shape[0]} tokens after expanding media, exceeds "
                               f"max_prompt_tokens={self.limits.max_prompt_tokens}")
        return ids

    def _pixels(self, items: list[Item]) -> np.ndarray:
        """Phase 2, once the output buffer exists: the rest is decoded and written straight into it,
        video frames a temporal patch at a time as their GOPs finish decoding."""
        rows = np.array([sum(t * h * w for t, h, w in item.grids) for item in items], dtype=np.int64)
        pixel_values = np.empty((int(rows.sum()), self.image_settings.row_size), dtype=np.float32)
        starts = np.concatenate([[0], np.cumsum(rows)])
        map_items(lambda i: fill(items[i], pixel_values[starts[i]:starts[i + 1]], self.limits), range(len(items)))
        return pixel_values

    def _assemble(self, ids: np.ndarray, items: list[Item], expansions: list, pixel_values: np.ndarray,
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
        largest_frame = max((h * w for item in items for _, h, w in item.grids), default=0)
        extras = [item_extras(item, self.family.processor, largest_frame) for item in items]
        extras = {extra.name: np.concatenate([e.get(extra.name, extra.empty(item.grids))
                                              for e, item in zip(extras, items)] + [extra.empty(np.zeros((0, 3)))])
                  for extra in EXTRAS}
        if self.family.processor.prompt_positions is not None:
            kinds = np.select([input_ids == self.image_token_id, input_ids == self.video_token_id], [1, 2], 0)
            positions, delta = self.family.processor.prompt_positions(input_ids, kinds, grids, self.config)
            media = np.zeros((3, 0), np.int64)
        elif rate > 0:
            positions, delta, media = pruned_mrope_positions(input_ids.shape[0], spans)
        else:
            positions, delta = mrope_positions(input_ids.shape[0], spans, self.family.processor.mrope_text_after)
            media = np.zeros((3, 0), np.int64)
        return PreprocessOutput(input_ids=input_ids, pixel_values=pixel_values, grid_thw=grids,
                                mrope_position_ids=positions, mrope_position_delta=delta,
                                media_position_ids=media, video_pruning_rate=rate, extras=extras)


def _special_tokens_around(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after an encoded text (a Llama
    tokenizer's `<s>`; none for most): what the whole prompt gets where its placeholders are text
    (the processor encodes the expanded prompt in one piece, special tokens added)."""
    bare = tokenizer.encode("a", add_special_tokens=False).ids
    whole = tokenizer.encode("a").ids
    start = next(i for i in range(len(whole) - len(bare) + 1) if whole[i:i + len(bare)] == bare)
    return whole[:start], whole[start + len(bare):]


def _text_input(text: str | bytes) -> str:
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput("text_input: not valid UTF-8") from None
    if not isinstance(text, str):
        raise InvalidInput("text_input: expected a string")
    return text
