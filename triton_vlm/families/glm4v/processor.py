"""The GLM variants' processor rules: their tokens, GLM's `smart_resize` (a video's pixel budget
covers all its frames), the three frame-sampling rules (GLM-4.1V's, GLM-4.6V's by duration,
GLMGA's), a video's prompt (a block of image tokens and a timestamp per temporal patch) and the
processor classes' default sizes.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from triton_vlm.errors import InvalidInput
from triton_vlm.families.base import MediaLayout, expand_plain
from triton_vlm.media.mrope import MediaSpan
from triton_vlm.media.sizing import smart_resize
from triton_vlm.media.videos import distinct_indices, video_facts

IMAGE_TOKEN, VIDEO_TOKEN = "<|image|>", "<|video|>"
BEGIN_IMAGE, END_IMAGE = "<|begin_of_image|>", "<|end_of_image|>"
BEGIN_VIDEO, END_VIDEO = "<|begin_of_video|>", "<|end_of_video|>"
ENDOFTEXT, USER, ASSISTANT, OBSERVATION = "<|endoftext|>", "<|user|>", "<|assistant|>", "<|observation|>"
SPECIAL_TOKENS = (ENDOFTEXT, "[gMASK]", "<sop>", "<|system|>", USER, ASSISTANT, OBSERVATION,
                  BEGIN_IMAGE, END_IMAGE, BEGIN_VIDEO, END_VIDEO, IMAGE_TOKEN, VIDEO_TOKEN)
# What generation stops on, as in the released checkpoints' generation_config.json.
EOS_TOKENS = (ENDOFTEXT, USER, OBSERVATION)

# ------------------------------------------------------------------------------------- resizing

def resize_rule(height: int, width: int, settings, num_frames: int, name: str) -> tuple[int, int]:
    """transformers' GLM `smart_resize`: the pixel budget `max_pixels` (`size.longest_edge`) covers
    all frames of a video (`t_bar * h_bar * w_bar`); an image counts as `temporal_patch_size` frames,
    a video as its frame count padded to a multiple of `temporal_patch_size`. Frames smaller than
    one `factor` are scaled up first. An aspect ratio over 200 raises `InvalidInput`."""
    factor, tps = settings.factor, settings.temporal_patch_size
    num_frames = max(tps, -(-num_frames // tps) * tps)
    if height <= 0 or width <= 0:
        raise InvalidInput(f"{name}: image has no pixels")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    return smart_resize(height, width, factor, settings.min_pixels, settings.max_pixels, name, num_frames, tps)


# ------------------------------------------------------------------------------- frame sampling
# Ports of the three transformers video processors' `sample_frames`. They return distinct
# increasing indices: where transformers appends the last index again to make the count even, the
# patchifier repeats the last frame to fill the temporal patch, which gives the same pixels, grid
# and timestamps. Where transformers fails (a clip too short to sample anything), the first frame
# is kept.

_MAX_SAMPLES = 1_000_000  # candidate indices one request may make the GLM-4.1V rule enumerate


def _no_frame_count(num_frames: int | None) -> None:
    if num_frames is not None:
        raise InvalidInput("num_frames: GLM samples video frames by time, not by count; use fps")


def sample_frames_glm4v(metadata, *, fps: float = 2.0, num_frames: int | None = None,
                        max_duration: float = 300, **_other_options) -> np.ndarray:
    """`Glm4vVideoProcessor.sample_frames`: `fps` frames a second up to `max_duration` seconds;
    a longer video gets `max_duration * fps` frames spread over its whole length. The shared
    sampler options it is also called with (min / max frames, ...) play no part, as in transformers."""
    _no_frame_count(num_frames)
    total, video_fps, duration = video_facts(metadata)
    max_idx = total - 1
    if duration <= max_duration:
        # Candidates past `bound` all give max_idx: enumerating one of them is enough.
        bound = (max_idx + 1) * fps / video_fps
        limit = min(duration * fps, bound + 2)
        if limit > _MAX_SAMPLES:
            raise InvalidInput(f"fps={fps:g} samples a {duration:g} s video more than {_MAX_SAMPLES} times")
        n = max(math.floor(limit), 1)
        indices = np.minimum(max_idx, np.ceil(np.arange(n) * video_fps / fps).astype(np.int64))
    else:
        num_samples = int(max_duration * fps)
        if num_samples >= total:
            indices = range(total)
        else:
            seconds = np.linspace(0, duration, num_samples, endpoint=True)
            indices = np.minimum(max_idx, np.ceil(seconds * video_fps).astype(np.int64))
    return distinct_indices(indices)


def _sample_by_seconds(total: int, video_fps: float, extract_t: int, step: float, stop: float,
                       spread) -> list[int]:
    """The loop GLM-4.6V and GLMGA share: each frame whose time reaches the next mark (marks `step`
    seconds apart) until a mark reaches `stop`; `spread(extract_t)` when the video has fewer frames
    than wanted; then stretched or thinned to exactly `extract_t` by `np.linspace`."""
    if total < extract_t:
        indices = spread(extract_t)
    else:
        indices, current = [], 0
        duration_per_frame = 1 / video_fps
        for i in range(total):
            if i * duration_per_frame >= current:
                current += step
                indices.append(i)
                if current >= stop:
                    break
    if len(indices) < extract_t:
        start, end = (indices[0], indices[-1]) if indices else (0, max(total - 1, 0))
        indices = np.linspace(start, end, extract_t, dtype=int).tolist()
    elif len(indices) > extract_t:
        indices = np.linspace(0, total - 1, extract_t, dtype=int).tolist()
    return indices


# GLM-4.6V: target fps by duration (up to 30 s: 3, up to 300 s: 1, longer: 0.5), durations past
# 2400 s count as 2400 s, at most 640 frames.
GLM46V_DYNAMIC_FPS = ((30, 3.0), (300, 1.0), (2400, 0.5))
GLM46V_MAX_FRAMES = 640
GLM46V_MAX_DURATION = 2400


def sample_frames_glm46v(metadata, *, num_frames: int | None = None, temporal_patch_size: int = 2,
                         **_other_options) -> np.ndarray:
    """`Glm46VVideoProcessor.sample_frames`: a frame rate chosen by the video's duration
    (`GLM46V_DYNAMIC_FPS`), `temporal_patch_size` frames per tick. Like transformers, the
    requested `fps` (and the other shared sampler options) play no part."""
    _no_frame_count(num_frames)
    total, video_fps, duration = video_facts(metadata)
    effective = min(duration, GLM46V_MAX_DURATION)
    target_fps = next(rate for limit, rate in GLM46V_DYNAMIC_FPS if effective <= limit)
    extract_t = min(int(effective * target_fps * temporal_patch_size), GLM46V_MAX_FRAMES)
    indices = _sample_by_seconds(
        total, video_fps, extract_t, step=1 / (temporal_patch_size * target_fps), stop=int(duration),
        spread=lambda n: np.linspace(0, total - 1, n, dtype=int).tolist())
    return distinct_indices(indices)


def sample_frames_glmga(metadata, *, fps: float = 2.0, num_frames: int | None = None,
                        max_frames: int = 640, **_other_options) -> np.ndarray:
    """`GlmgaVideoProcessor.sample_frames`: `fps` (2) frames a second, at most `max_frames`."""
    _no_frame_count(num_frames)
    total, video_fps, duration = video_facts(metadata)
    extract_t = min(int(duration * fps), max_frames)
    indices = _sample_by_seconds(
        total, video_fps, extract_t, step=1 / fps, stop=duration - 1 / fps,
        spread=lambda n: [math.floor(i * total / n) for i in range(n)])
    return distinct_indices(indices)


# ------------------------------------------------------------------------------ video prompt

def timestamp_glm4v(seconds: float) -> str:
    return str(int(seconds))


def timestamp_seconds(seconds: float) -> str:
    return f"{seconds:.1f} seconds"


def expand_media(media: MediaLayout, token_id: Callable[[str], int], encode: Callable[[list[str]], list[list[int]]],
                 *, timestamp_text: Callable[[float], str]) -> tuple[np.ndarray, list[MediaSpan]]:
    """An image: `expand_plain`. A video's `<|video|>` token (`Glm4vProcessor.replace_video_token`):
    per temporal patch `<|begin_of_image|>`, h * w `<|image|>` tokens, `<|end_of_image|>` and the
    timestamp text of its first frame; each temporal patch is its own M-RoPE grid (t = 1)."""
    if not media.video:
        return expand_plain(media, token_id, encode)
    t, h, w = media.merged_grid
    stamps = list(media.timestamps[::2])[:t]  # transformers takes every second frame's time, not every tps-th
    stamps += [stamps[-1] if stamps else 0] * (t - len(stamps))
    texts = encode([timestamp_text(s) for s in stamps])
    begin, end, frame = token_id(BEGIN_IMAGE), token_id(END_IMAGE), token_id(IMAGE_TOKEN)
    pieces, spans, offset = [], [], 0
    for text in texts:
        pieces += [np.array([begin], np.int32), np.full(h * w, frame, np.int32), np.array([end, *text], np.int32)]
        spans.append(MediaSpan(offset + 1, 1, h, w))
        offset += h * w + 2 + len(text)
    return np.concatenate(pieces), spans


# The processors' class-default sizes (`size.shortest_edge`, `size.longest_edge`), for checkpoints
# whose processor config leaves them out.
IMAGE_SIZE_DEFAULT = (112 * 112, 28 * 28 * 15000)
VIDEO_SIZE_DEFAULT = (112 * 112, 28 * 28 * 2 * 30000)
GLMGA_VIDEO_SIZE_DEFAULT = (112 * 112, 28 * 28 * 2 * 55790)


