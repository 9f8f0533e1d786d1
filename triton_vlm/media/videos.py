"""Request videos into frames (PyAV): demuxed once (`demux_video`), sampled by the family's rule,
decoded whole or, for H.264, only the chosen frames' GOPs (`PlannedVideo`). Every failure raises
`InvalidInput` naming the input (`videos[0]: not a decodable video`), never with library details.
"""
from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from triton_vlm.contract.limits import DEFAULT_LIMITS, Limits
from triton_vlm.errors import InvalidInput
from triton_vlm.media.images import check_frame_size


def _positive(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if value > 0 and math.isfinite(value) else None


def video_facts(metadata) -> tuple[int, float, float]:
    """(total frames, fps, duration) of a video's metadata: a `VideoMetadata`-like object or a
    mapping; other keys or attributes are ignored. A missing, zero or non-finite fps is derived
    from the frame count and duration; with neither, `InvalidInput` (never a division by zero).
    A missing duration is transformers' `round((total - 1) / fps) + 1`."""
    get = metadata.get if isinstance(metadata, Mapping) else (lambda key: getattr(metadata, key, None))
    total = _positive(get("total_num_frames"))
    if total is None or total != int(total):
        raise InvalidInput("video has no frames")
    total = int(total)
    fps, duration = _positive(get("fps")), _positive(get("duration"))
    if fps is None:
        if duration is None:
            raise InvalidInput("video has neither a frame rate nor a duration")
        fps = total / duration
    if duration is None:
        duration = round((total - 1) / fps) + 1
    return total, fps, duration


def distinct_indices(indices) -> np.ndarray:
    """A sampler's frame indices without repeats, first occurrences in order; the first frame if none."""
    return np.array(list(dict.fromkeys(int(i) for i in indices)) or [0], dtype=np.int64)


@dataclass
class VideoMetadata:
    """What transformers' `VideoMetadata` holds, for the decoded file and its sampled frames."""
    total_num_frames: int
    fps: float
    width: int
    height: int
    duration: float
    frames_indices: np.ndarray | None = None

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sampled frames (transformers' `VideoMetadata.sampled_fps`)."""
        if self.frames_indices is None or not self.total_num_frames:
            return self.fps
        return len(self.frames_indices) / self.total_num_frames * self.fps

    @property
    def timestamps(self) -> np.ndarray:
        """Seconds of the sampled frames (transformers' `VideoMetadata.timestamps`)."""
        return np.asarray(self.frames_indices) / self.fps


# A sampler gets the file's metadata and returns the frame indices to keep, increasing.
Sampler = Callable[[VideoMetadata], np.ndarray]
# A resizer gets the metadata (frames_indices set) and returns the frames' target (height, width)
# and the function resizing uint8 frames [n, H, W, 3] to it.
Resizer = Callable[[VideoMetadata], tuple[tuple[int, int], Callable[[np.ndarray], np.ndarray]]]

_FALLBACK_FPS = 24.0  # transformers' VideoMetadata.sampled_fps default when the rate is unknown


def video_errors() -> tuple[type[BaseException], ...]:
    """What PyAV raises for a file it cannot read: FFmpeg's errors, and UnicodeDecodeError for
    metadata strings that are not text. Anything else is our bug (INTERNAL)."""
    import av

    return (av.error.FFmpegError, UnicodeDecodeError)


def _open_container(data: bytes, name: str):
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except video_errors():
        raise InvalidInput(f"{name}: not a decodable video") from None
    if not container.streams.video or container.streams.video[0].codec_context is None:
        container.close()
        raise InvalidInput(f"{name}: no decodable video stream")
    return container


def _stream_fps(stream, container, frames: int, timestamps: list[int] | None = None) -> float:
    """The stream's frame rate: its average (else guessed) rate as transformers' pyav loader reads
    it; where the container has none (missing or 0), derived from the frame timestamps, then from
    the duration. Never zero, never a division by zero."""
    for rate in (stream.average_rate, stream.guessed_rate):
        try:
            value = float(rate) if rate is not None else 0.0
        except (ZeroDivisionError, ValueError, TypeError):
            value = 0.0
        if value > 0 and math.isfinite(value):
            return value
    if timestamps and len(timestamps) > 1 and stream.time_base:
        span = (max(timestamps) - min(timestamps)) * float(stream.time_base)
        if span > 0 and math.isfinite(span):
            return (len(timestamps) - 1) / span
    duration = 0.0
    if stream.duration and stream.time_base:
        duration = float(stream.duration * stream.time_base)
    elif container.duration:
        duration = container.duration / 1_000_000
    if frames > 0 and duration > 0:
        return frames / duration
    return _FALLBACK_FPS


@dataclass
class DemuxedVideo:
    """A video file read once (`demux_video`): its stream facts and its packets with a payload, in
    decode order. Every decode below feeds these packets to a fresh decoder; nothing demuxes again."""
    data: bytes
    name: str
    limits: Limits
    facts: dict
    packets: list

    def frames(self):
        """Every frame, decoded from the packets (the decoder's own threads)."""
        container = _open_container(self.data, self.name)  # a decoder with the stream's parameters
        try:
            codec = container.streams.video[0].codec_context
            codec.thread_type = "AUTO"
            for packet in self.packets + [None]:
                yield from codec.decode(packet)
        finally:
            container.close()

    def plan(self, sampler: Sampler) -> PlannedVideo | None:
        """The sampled frames, known before decoding anything, where the fast path can decode them
        (AVCC H.264): `.meta` has `frames_indices`; `.decode(store)` then calls `store(k, frame)`
        for each kept frame (from worker threads). None: use `decode`."""
        plan = _h264_plan(self.facts, self.packets)
        if plan is None:
            return None
        f = self.facts
        meta, _ = _sample(len(plan), f["fps"], f["width"], f["height"], self.name, sampler, self.limits)
        return PlannedVideo(meta, plan, self.packets, self.data)

    def decode(self, sampler: Sampler, resizer: Resizer | None = None) -> tuple[np.ndarray, VideoMetadata]:
        """Decode every frame up to the last one `sampler` keeps (see `decode_video`)."""
        try:
            total = self.facts["header_frames"]
            if total <= 0:  # container without a frame count: count by decoding
                total = self._count()
            meta, frames, decoded = self._decode_sampled(total, sampler, resizer)
            if decoded < total:
                # The header promised more frames than the stream holds: sample again from the real count.
                meta, frames, redecoded = self._decode_sampled(decoded, sampler, resizer)
                if redecoded < decoded:
                    raise InvalidInput(f"{self.name}: not a decodable video")
        except video_errors():
            raise InvalidInput(f"{self.name}: not a decodable video") from None
        return frames, meta

    def _count(self) -> int:
        """Frames in the stream; stops one past `max_video_source_frames`, which `_sample` refuses."""
        total = 0
        for _ in self.frames():
            total += 1
            if total > self.limits.max_video_source_frames:
                break
        return total

    def _decode_sampled(self, total: int, sampler: Sampler, resizer: Resizer | None):
        """Decode up to the last sampled frame, converting only the sampled ones to RGB.

        Returns (metadata, frames, frames decoded); frames decoded < total means the stream ended early.
        """
        f = self.facts
        meta, indices = _sample(total, f["fps"], f["width"], f["height"], self.name, sampler, self.limits)
        out, store = _output(meta, indices, f["width"], f["height"], resizer)
        last, k, i = int(indices[-1]), 0, -1
        wanted = int(indices[0])
        for i, frame in enumerate(self.frames()):
            if i == wanted:
                store(k, frame)
                k += 1
                if i == last:
                    break
                wanted = int(indices[k])
        decoded = i + 1
        if k < indices.size:  # stream shorter than the header said
            if decoded <= 0:
                raise InvalidInput(f"{self.name}: video has no decodable frames")
            return meta, out[:k], decoded
        return meta, out, max(decoded, total)


def demux_video(data: bytes, name: str, limits: Limits = DEFAULT_LIMITS) -> DemuxedVideo:
    """Read the container once: stream facts and packets; decodes nothing."""
    container = _open_container(data, name)
    try:
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        check_frame_size(width, height, name, limits, "video frame")
        packets = []
        for packet in container.demux(stream):
            if packet.size:
                packets.append(packet)
                if len(packets) > limits.max_video_source_frames:
                    raise InvalidInput(f"{name}: more than max_video_source_frames="
                                       f"{limits.max_video_source_frames} frames")
        timestamps = [p.pts for p in packets if p.pts is not None]
        fps = _stream_fps(stream, container, int(stream.frames or 0) or len(packets), timestamps)
        facts = dict(width=width, height=height, header_frames=int(stream.frames or 0), fps=fps,
                     codec=stream.codec_context.name, extradata=bytes(stream.codec_context.extradata or b""))
    except video_errors():
        raise InvalidInput(f"{name}: not a decodable video") from None
    finally:
        container.close()
    return DemuxedVideo(data, name, limits, facts, packets)


def decode_video(data: bytes, name: str, sampler: Sampler, limits: Limits = DEFAULT_LIMITS,
                 resizer: Resizer | None = None) -> tuple[np.ndarray, VideoMetadata]:
    """Decode the frames `sampler` keeps: uint8 [T, H, W, 3] and the file's metadata with
    `frames_indices` set. With a `resizer`, each kept frame is resized as soon as it is decoded (no
    full-size copy of the video is kept) and the result is [T, h, w, 3] at the size the resizer chose.

    Frames are counted and sampled as transformers' pyav loader does (the header's frame count,
    frame i = the i-th decoded frame, pixels as stored: like that loader, rotation metadata is
    not applied). H.264 takes a fast path that feeds the decoder only the packets the kept frames
    need (whole GOPs without a kept frame and non-reference frames not kept are skipped); anything
    it cannot vouch for falls back to decoding every frame up to the last kept one.
    """
    video = demux_video(data, name, limits)
    planned = video.plan(sampler)
    if planned is not None:
        out, store = _output(planned.meta, planned.meta.frames_indices, video.facts["width"], video.facts["height"],
                             resizer)
        if planned.decode(store):
            return out, planned.meta
    return video.decode(sampler, resizer)


def _h264_nal_info(payload: bytes, length_size: int) -> tuple[bool, bool] | None:
    """(is IDR, is a reference picture) of one AVCC (length-prefixed) H.264 access unit; None when
    it does not parse."""
    pos, n, vcl, idr, ref = 0, len(payload), False, False, False
    while pos + length_size <= n:
        size = int.from_bytes(payload[pos:pos + length_size], "big")
        pos += length_size
        if size <= 0 or pos + size > n:
            return None
        header = payload[pos]
        nal_type, ref_idc = header & 0x1F, (header >> 5) & 3
        if 1 <= nal_type <= 5:
            vcl = True
            idr |= nal_type == 5
            ref |= ref_idc != 0
        pos += size
    if pos != n or not vcl:
        return None
    return idr, ref


def _h264_plan(facts: dict, packets: list):
    """Per packet (decode order): (pts, is IDR, is reference), when the stream is AVCC H.264 whose
    packets map one to one onto the header's frames with distinct timestamps; else None."""
    extradata = facts["extradata"]
    if facts["codec"] != "h264" or len(extradata) < 7 or extradata[0] != 1:
        return None
    if not packets or facts["header_frames"] != len(packets):
        return None
    length_size = (extradata[4] & 3) + 1
    plan = []
    for packet in packets:
        if packet.pts is None:
            return None
        info = _h264_nal_info(bytes(packet), length_size)
        if info is None:
            return None
        plan.append((int(packet.pts), *info))
    if len({pts for pts, _, _ in plan}) != len(plan) or not plan[0][1]:
        return None
    return plan


def frame_rgb(frame, width: int, height: int) -> np.ndarray:
    """A decoded frame as uint8 RGB [height, width, 3] (as transformers' pyav loader converts it)."""
    if frame.width != width or frame.height != height:
        return frame.to_ndarray(format="rgb24", width=width, height=height)
    return frame.to_ndarray(format="rgb24")


def _output(meta: VideoMetadata, indices: np.ndarray, width: int, height: int, resizer: Resizer | None):
    """(output buffer, per-frame store function) for the kept frames."""
    if resizer is None:
        out = np.empty((indices.size, height, width, 3), dtype=np.uint8)

        def store(k: int, frame) -> None:
            out[k] = frame_rgb(frame, width, height)
    else:
        (th, tw), resize = resizer(meta)
        out = np.empty((indices.size, th, tw, 3), dtype=np.uint8)

        def store(k: int, frame) -> None:
            out[k] = resize(frame_rgb(frame, width, height)[None])[0]
    return out, store


class PlannedVideo:
    """Decode only what the sampled frames need, GOPs in parallel."""

    def __init__(self, meta: VideoMetadata, plan, packets, data: bytes):
        self.meta, self.packets, self.data = meta, packets, data
        total = len(plan)
        order = sorted(pts for pts, _, _ in plan)
        # pts of a kept frame -> output row
        self.slot = {order[int(i)]: k for k, i in enumerate(meta.frames_indices)}
        # GOPs (IDR to IDR, decode order) holding a kept frame; in each, the reference pictures and
        # the kept frames up to the last kept one in decode order (references come before their use).
        self.tasks, gop_start = [], 0
        for j in range(1, total + 1):
            if j == total or plan[j][1]:
                kept = [q for q in range(gop_start, j) if plan[q][0] in self.slot]
                if kept:
                    self.tasks.append([q for q in range(gop_start, kept[-1] + 1)
                                       if plan[q][2] or plan[q][0] in self.slot])
                gop_start = j

    def decode(self, store: Callable[[int, object], None]) -> bool:
        """False when the result cannot be vouched for (the caller then decodes everything)."""
        workers = max(1, min(len(self.tasks), os.cpu_count() or 1))
        try:
            if workers == 1:
                results = [self._run(task, "AUTO", store) for task in self.tasks]
            else:
                with ThreadPoolExecutor(workers) as pool:
                    results = list(pool.map(lambda task: self._run(task, "NONE", store), self.tasks))
        except video_errors():
            return False
        return all(r is not None for r in results) and sum(results) == len(self.slot)

    def _run(self, task: list[int], thread_type: str, store) -> int | None:
        import av

        container = av.open(io.BytesIO(self.data), mode="r")  # own decoder with the stream's parameters
        try:
            stream = container.streams.video[0]
            stream.thread_type = thread_type
            codec = stream.codec_context
            filled, last_pts = 0, None
            for packet in [self.packets[q] for q in task] + [None]:
                for frame in codec.decode(packet):
                    if frame.pts is None or (last_pts is not None and frame.pts <= last_pts):
                        return None
                    last_pts = frame.pts
                    k = self.slot.get(frame.pts)
                    if k is not None:
                        store(k, frame)
                        filled += 1
            return filled
        finally:
            container.close()


def _sample(total, fps, width, height, name, sampler, limits):
    if total <= 0:
        raise InvalidInput(f"{name}: video has no decodable frames")
    if total > limits.max_video_source_frames:
        raise InvalidInput(f"{name}: {total} frames exceed max_video_source_frames="
                           f"{limits.max_video_source_frames}")
    meta = VideoMetadata(total_num_frames=total, fps=fps, width=width, height=height, duration=total / fps)
    try:
        indices = np.asarray(sampler(meta), dtype=np.int64)
    except InvalidInput as e:
        raise InvalidInput(f"{name}: {e}") from None
    if indices.size == 0 or indices[0] < 0 or indices[-1] >= total or np.any(np.diff(indices) <= 0):
        raise InvalidInput(f"{name}: no frames to sample")
    if indices.size > limits.max_video_frames:
        raise InvalidInput(f"{name}: {indices.size} frames exceed max_frames={limits.max_video_frames}")
    meta.frames_indices = indices
    return meta, indices
