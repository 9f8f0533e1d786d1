"""Synthetic media for the demo, tests and benchmarks: encoded bytes, made here (no downloads)."""
from __future__ import annotations

import io

import numpy as np


def _scene(width: int, height: int, t: float = 0.0) -> np.ndarray:
    """A gradient with a moving square: smooth and structured, so codecs behave as on real media."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    frame = np.stack([x / max(width - 1, 1), y / max(height - 1, 1), 0.5 + 0.5 * np.sin((x + y) / 17.0 + t)], -1)
    size = max(4, min(width, height) // 4)
    cx = int((width - size) * (0.5 + 0.4 * np.sin(t)))
    cy = int((height - size) * (0.5 + 0.4 * np.cos(t)))
    frame[cy:cy + size, cx:cx + size] = (1.0, 0.2, 0.1)
    return (frame * 255).astype(np.uint8)


def image_bytes(width: int = 640, height: int = 480, fmt: str = "JPEG", seed: float = 0.0) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(_scene(width, height, seed)).save(buffer, format=fmt)
    return buffer.getvalue()


def video_bytes(seconds: float = 2.0, fps: int = 10, width: int = 160, height: int = 120,
                codec: str = "libx264", container: str = "mp4") -> bytes:
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(max(1, int(round(seconds * fps)))):
            frame = av.VideoFrame.from_ndarray(_scene(width, height, i / fps * 2.0), format="rgb24")
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return buffer.getvalue()


def document_bytes(width: int = 200, height: int = 150, text_box: tuple[int, int, int, int] | None = None,
                   dark: bool = False, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A page of small dense "glyphs" (3 x 7 pixel marks on a 6 x 11 pitch, as small print) inside
    `text_box` (left, top, right, bottom; default the whole page), the rest blank; `dark`: light
    text on a dark page."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    page = np.full((height, width, 3), 245, np.uint8)
    left, top, right, bottom = text_box or (0, 0, width, height)
    for y in range(top + 2, bottom - 7, 11):
        for x in range(left + 2, right - 3, 6):
            if rng.random() < 0.85:
                page[y:y + 7, x:x + 3] = rng.integers(0, 60)
    buffer = io.BytesIO()
    Image.fromarray(255 - page if dark else page).save(buffer, format=fmt)
    return buffer.getvalue()
