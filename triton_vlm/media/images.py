"""Request media items into bytes and images: raw / base64 / data: URL bytes (`decode_item_bytes`),
images decoded and probed with Pillow (`decode_image`, `probe_image`). Every failure raises
`InvalidInput` naming the input (`images[1]: not a decodable image`), never with library details.
"""
from __future__ import annotations

import binascii
import io
import struct
import urllib.parse
import warnings

import numpy as np

from triton_vlm.contract.limits import DEFAULT_LIMITS, Limits
from triton_vlm.errors import InvalidInput

_B64_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_ \t\r\n"


def decode_item_bytes(raw: bytes | str, name: str = "input", limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The media file held by `raw`: the raw file itself, its base64 text, or a `data:` URL.

    A raw media file is never valid base64 text (image and video containers start with bytes
    outside the base64 alphabet), so anything made only of base64 characters is base64.
    """
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    elif not isinstance(raw, (bytes, bytearray, memoryview)):
        raise InvalidInput(f"{name}: expected bytes")
    raw = bytes(raw)
    if len(raw) > limits.max_item_bytes * 4 // 3 + 1024:
        raise InvalidInput(f"{name}: {len(raw)} bytes exceed max_item_bytes={limits.max_item_bytes}")
    if not raw:
        raise InvalidInput(f"{name}: empty item")
    head = raw[:5].lower()
    if head == b"data:":
        comma = raw.find(b",")
        if comma < 0:
            raise InvalidInput(f"{name}: malformed data: URL")
        meta, payload = raw[5:comma].lower(), raw[comma + 1:]
        if meta.endswith(b";base64"):
            data = _b64decode(payload, name)
        else:
            data = urllib.parse.unquote_to_bytes(payload)
    elif not raw[:64].translate(None, _B64_CHARS) and not raw.translate(None, _B64_CHARS):
        data = _b64decode(raw, name)
    else:
        data = raw
    if len(data) > limits.max_item_bytes:
        raise InvalidInput(f"{name}: {len(data)} bytes exceed max_item_bytes={limits.max_item_bytes}")
    if not data:
        raise InvalidInput(f"{name}: empty item")
    return data


def _b64decode(text: bytes, name: str) -> bytes:
    text = text.translate(None, b" \t\r\n")
    if b"-" in text or b"_" in text:
        text = text.replace(b"-", b"+").replace(b"_", b"/")
    text = text.rstrip(b"=")
    text += b"=" * (-len(text) % 4)
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{name}: invalid base64") from None


def image_errors() -> tuple[type[BaseException], ...]:
    """What Pillow raises for a file it cannot read (its plugins' own errors: OSError, of which
    UnidentifiedImageError and truncation are, SyntaxError, ValueError, EOFError, struct.error);
    anything else is our bug."""
    return (OSError, SyntaxError, ValueError, EOFError, struct.error)


def _open_image(data: bytes, name: str, limits: Limits):
    """Open an image from its header alone (nothing decoded yet) and check its size limits."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise InvalidInput(f"{name}: image exceeds max_image_pixels={limits.max_image_pixels}") from None
    except image_errors() as error:
        raise not_decodable_image(name, data, error) from None
    check_frame_size(*image.size, name, limits, "image")
    return image


def not_decodable_image(name: str, data: bytes, error: Exception | str) -> InvalidInput:
    """The refusal of an image, with what arrived and why it failed, so that a client can tell a
    truncated or mangled upload from a format Pillow does not read."""
    from PIL import UnidentifiedImageError

    reason = "not an image format Pillow reads" if isinstance(error, UnidentifiedImageError) else str(error)
    return InvalidInput(f"{name}: not a decodable image ({len(data)} bytes: {reason})")


def decode_image(data: bytes, name: str, limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """Decode an image file to uint8 RGB [H, W, 3] (first frame of animated images).

    RGB conversion follows transformers' `convert_to_rgb`: images with transparency are
    composited onto white, everything else goes through Pillow's `convert("RGB")`. EXIF
    orientation is applied as transformers' `load_image` does.
    """
    from PIL import Image, ImageOps

    image = _open_image(data, name, limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image.seek(0)
            image.load()
            if image.getexif().get(0x0112, 1) != 1:  # EXIF orientation, as transformers' load_image
                image = ImageOps.exif_transpose(image)
            has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
            if has_alpha:
                rgba = image.convert("RGBA")
                background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                image = Image.alpha_composite(background, rgba).convert("RGB")
            elif image.mode != "RGB":
                image = image.convert("RGB")
            array = np.asarray(image)
    except image_errors() as error:
        raise not_decodable_image(name, data, error) from None
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise not_decodable_image(name, data, f"decoded to an array of shape {array.shape}, {array.dtype}")
    return array


def probe_image(data: bytes, name: str, limits: Limits = DEFAULT_LIMITS) -> tuple[int, int] | None:
    """(height, width) `decode_image` will return, read from the header (limits checked), or None
    when the header cannot tell (then decode to know)."""
    image = _open_image(data, name, limits)
    width, height = image.size
    if image.format != "JPEG":  # other formats may carry EXIF after the pixels
        return None
    try:
        orientation = image.getexif().get(0x0112, 1)
    except image_errors():
        return None
    return (width, height) if orientation in (5, 6, 7, 8) else (height, width)


def check_frame_size(width: int, height: int, name: str, limits: Limits, what: str) -> None:
    if width <= 0 or height <= 0:
        raise InvalidInput(f"{name}: {what} has no pixels")
    if width * height > limits.max_image_pixels:
        raise InvalidInput(f"{name}: {what} of {width}x{height} pixels exceeds "
                           f"max_image_pixels={limits.max_image_pixels}")
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise InvalidInput(f"{name}: aspect ratio {ratio:.1f} of {width}x{height} exceeds "
                           f"max_aspect_ratio={limits.max_aspect_ratio:g}")

