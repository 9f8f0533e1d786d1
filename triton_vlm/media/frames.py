"""Frames into the vision tower's `pixel_values` rows, as the Hugging Face torchvision-backend
processors compute them:

resize on uint8 (torchvision BICUBIC, antialias; CLIP's processors then cut the centre crop,
`View.crop`), then float32 with the fused
rescale + normalize (mean and std scaled by 1 / rescale_factor), then the patch layout
`[grid_t * grid_h * grid_w, C * temporal_patch_size * patch * patch]`.

Resize once (uint8), normalise once on planar float32 (contiguous, vectorised), then one strided
copy into the caller's output buffer in the patch layout; no float64, no padding copies.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from triton_vlm.media.sizing import VisionSettings, grid_thw

# PIL resampling codes (as processor configs store them) to torchvision interpolation names.
_RESAMPLE = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}


@dataclass(frozen=True)
class View:
    """A frame (or only its `region` (top, bottom, left, right): an adaptive tile), padded to a
    square of colour `fill` (None: not padded), resized to `size`, centre-cropped to `crop` (a CLIP
    processor's; None: not cropped; larger than `size`: padded with zeros, an anyres tile canvas),
    then cut into `rows` x `cols` equal slices (1 x 1: kept whole)."""
    size: tuple[int, int]
    rows: int = 1
    cols: int = 1
    crop: tuple[int, int] | None = None
    region: tuple[int, int, int, int] | None = None
    fill: tuple[int, int, int] | None = None

    @property
    def pixels(self) -> tuple[int, int]:
        """(height, width) of the view's pixels: the crop, else the resized size."""
        return self.crop or self.size

    @property
    def slice_size(self) -> tuple[int, int]:
        return self.pixels[0] // self.rows, self.pixels[1] // self.cols

    def resize(self, frames: np.ndarray, settings: VisionSettings) -> np.ndarray:
        """uint8 frames [T, H, W, 3] (their region) resized to `size`, then cropped."""
        if self.region is not None:
            top, bottom, left, right = self.region
            frames = frames[:, top:bottom, left:right]
        if self.fill is not None:
            frames = pad_to_square(frames, self.fill)
        frames = resize_frames(frames, self.size, settings)
        return frames if self.crop is None else center_crop(frames, self.crop)


def pad_to_square(frames: np.ndarray, fill: tuple[int, int, int]) -> np.ndarray:
    """transformers' `pad_to_square` of uint8 frames [T, H, W, 3]: the shorter side padded with
    `fill` to the longer, the odd pixel at the end."""
    h, w = frames.shape[1:3]
    if h == w:
        return frames
    side = max(h, w)
    out = np.empty((frames.shape[0], side, side, 3), dtype=np.uint8)
    out[:] = np.asarray(fill, dtype=np.uint8)
    top, left = (side - h) // 2, (side - w) // 2
    out[:, top:top + h, left:left + w] = frames
    return out


def center_crop(frames: np.ndarray, crop: tuple[int, int]) -> np.ndarray:
    """transformers' torchvision-backend `center_crop` of uint8 frames [T, H, W, 3]: a side shorter
    than the crop is first padded with zeros (the extra pixel, if odd, at the end), then the
    window at (int((H - h) / 2), int((W - w) / 2)) is kept (a view, no copy)."""
    (ch, cw), (h, w) = crop, frames.shape[1:3]
    if ch > h or cw > w:
        pad_h, pad_w = max(ch - h, 0), max(cw - w, 0)
        frames = np.pad(frames, ((0, 0), (pad_h // 2, (pad_h + 1) // 2), (pad_w // 2, (pad_w + 1) // 2), (0, 0)))
        h, w = frames.shape[1:3]
    top, left = int((h - ch) / 2.0), int((w - cw) / 2.0)
    return frames[:, top:top + ch, left:left + cw]


@dataclass(frozen=True)
class FrameLayout:
    """How a media item's frames become vision-tower inputs.

    One view, `per_frame` False (Qwen2-VL-style processors): the frames resized to one size, temporal patches
    of `temporal_patch_size` frames, one grid row [t, h, w] for the item. Otherwise (sliced images)
    every slice of every view of every frame is its own image: a grid row [1, h, w] each, frame
    by frame, views and slices in order (slices row-major). Between decoding and writing the
    pixel rows a frame is kept as `stored` uint8 pixels: the single view's (h, w), or all views'
    pixels one after the other as one (1, n) row, then the `tiles`'.

    `tiles` (adaptive slices, `ProcessorRules.refine_layout`): per slice of the sliced view, row-major, None for the
    slice itself or a whole `View` (its own size, from a region of the frame) that takes its place.
    `packing` (per-frame layouts: packed video frames, an anyres image's base view
    and tiles) groups consecutive grid rows, all of one size, into one grid row [rows, h, w] each;
    the pixel rows are the same.
    """
    views: tuple[View, ...]
    per_frame: bool = False
    tiles: tuple[View | None, ...] = ()
    packing: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.packing and (not self.per_frame or self.tiles):
            raise ValueError("packed rows need a per-frame layout without tiles")

    @property
    def _parts(self) -> tuple[View, ...]:
        """What is resized and stored: the views, then the tiles."""
        return self.views + tuple(t for t in self.tiles if t is not None)

    @property
    def stored(self) -> tuple[int, int]:
        if len(self._parts) == 1:
            return self.views[0].pixels
        return 1, sum(v.pixels[0] * v.pixels[1] for v in self._parts)

    def _pieces(self) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
        """Each grid row's pixels, prompt order, as (index into `_parts`, (top, left) in its pixels,
        (h, w)): every view's slices row-major, a tile in the place of the slice it replaces."""
        pieces, next_tile, k = [], len(self.views), 0
        for i, view in enumerate(self.views):
            sh, sw = view.slice_size
            for r in range(view.rows):
                for c in range(view.cols):
                    tile = self.tiles[k] if self.tiles and view.rows * view.cols > 1 else None
                    k += view.rows * view.cols > 1
                    if tile is None:
                        pieces.append((i, (r * sh, c * sw), (sh, sw)))
                    else:
                        pieces.append((next_tile, (0, 0), tile.pixels))
                        next_tile += 1
        return pieces

    def grids(self, num_frames: int, settings: VisionSettings) -> list[tuple[int, int, int]]:
        """The item's grid_thw rows, prompt order."""
        if not self.per_frame:
            return [grid_thw(num_frames, self.views[0].pixels, settings)]
        p = settings.patch_size
        rows = [(1, h // p, w // p) for _, _, (h, w) in self._pieces()] * num_frames
        if not self.packing:
            return rows
        if sum(self.packing) != len(rows):
            raise ValueError(f"packing {list(self.packing)} does not cover {len(rows)} grid rows")
        packed, start = [], 0
        for n in self.packing:
            if len(set(rows[start:start + n])) != 1:
                raise ValueError("packed grid rows differ in size")
            packed.append((n, *rows[start][1:]))
            start += n
        return packed

    def resize(self, frames: np.ndarray, settings: VisionSettings) -> np.ndarray:
        """uint8 frames [T, H, W, 3] -> [T, *stored, 3]: every view resized from the frame itself."""
        if len(self._parts) == 1:
            return self.views[0].resize(frames, settings)
        return np.concatenate([v.resize(frames, settings).reshape(frames.shape[0], 1, -1, 3) for v in self._parts],
                              axis=2)

    def write(self, stored: np.ndarray, settings: VisionSettings, out: np.ndarray) -> None:
        """Normalise and patchify stored frames [T, *stored, 3] into `out` (the frames' rows)."""
        if not self.per_frame:
            write_pixel_values(stored, self.views[0].pixels, settings, out)
            return
        if settings.temporal_patch_size != 1:
            raise ValueError("per-frame layouts need temporal_patch_size 1")
        p, row, pieces = settings.patch_size, 0, self._pieces()
        for frame in stored:
            pixels, parts = frame.reshape(-1, 3), []
            for part in self._parts:
                h, w = part.pixels
                parts.append(pixels[:h * w].reshape(1, h, w, 3))
                pixels = pixels[h * w:]
            for i, (top, left), (h, w) in pieces:
                n = (h // p) * (w // p)
                write_pixel_values(parts[i][:, top:top + h, left:left + w], (h, w), settings, out[row:row + n])
                row += n


def _interpolation(resample: int):
    from torchvision.transforms.v2 import InterpolationMode

    try:
        return getattr(InterpolationMode, _RESAMPLE[int(resample)])
    except (KeyError, AttributeError, ValueError, TypeError):
        raise ValueError(f"unsupported resample {resample!r}") from None


def _norm_tensors(settings: VisionSettings):
    """Mean / std as the HF torchvision backend builds them (fused with the rescale factor)."""
    import torch

    if settings.do_rescale and settings.do_normalize:
        mean = torch.tensor(settings.image_mean) * (1.0 / settings.rescale_factor)
        std = torch.tensor(settings.image_std) * (1.0 / settings.rescale_factor)
    else:
        mean, std = torch.tensor(settings.image_mean), torch.tensor(settings.image_std)
    return mean, std


def resize_frames(frames: np.ndarray, size: tuple[int, int], settings: VisionSettings) -> np.ndarray:
    """uint8 frames [T, H, W, 3] resized to `size` as `write_pixel_values` resizes them (the same
    torch kernel, frame by frame identical to the batched call): uint8 [T, h, w, 3]. Resizing a
    frame to its own size returns it unchanged, as torchvision does."""
    import torch

    if not settings.do_resize or tuple(frames.shape[1:3]) == tuple(size):
        return frames
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only input views: only read here
        x = torch.from_numpy(frames).permute(0, 3, 1, 2)
    x = _resize(x, size, settings)
    return x.permute(0, 2, 3, 1).contiguous().numpy()


def _resize(x, size: tuple[int, int], settings: VisionSettings):
    """uint8 frames [T, C, H, W] (a torch view) resized to `size` by `settings.backend`."""
    import torch
    import torchvision.transforms.v2.functional as tvF

    if settings.backend == "torchvision":
        return tvF.resize(x, list(size), interpolation=_interpolation(settings.resample), antialias=True)
    if settings.backend != "pil":
        raise ValueError(f"unsupported backend {settings.backend!r}")
    from PIL import Image

    if tuple(x.shape[2:]) == tuple(size):
        return x
    height, width = size
    frames = [np.asarray(Image.fromarray(frame.permute(1, 2, 0).numpy()).resize((width, height),
                                                                              resample=int(settings.resample)))
              for frame in x]
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)


def write_pixel_values(frames: np.ndarray, size: tuple[int, int], settings: VisionSettings,
                       out: np.ndarray) -> tuple[int, int, int]:
    """Resize, normalise and patchify uint8 frames [T, H, W, 3] into `out` (float32, C-contiguous,
    shape [grid_t * grid_h * grid_w, row_size]). Returns the grid (t, h, w)."""
    import torch

    p, m, tps = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    height, width = size
    gt, gh, gw = grid_thw(frames.shape[0], size, settings)
    if out.shape != (gt * gh * gw, settings.row_size) or out.dtype != np.float32:
        raise ValueError("output buffer has the wrong shape or dtype")

    # [T, C, H, W] uint8 view of the channels-last frames: torch's uint8 antialiased resize runs
    # channels-last internally, so this gives transformers' values bit for bit, several times faster
    # than making the tensor NCHW-contiguous first. Nothing writes to this view.
    if frames.flags.writeable:
        x = torch.from_numpy(frames)
    else:  # decoded images are read-only views of Pillow's buffer; only read here
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            x = torch.from_numpy(frames)
    x = x.permute(0, 3, 1, 2)
    if settings.do_resize:
        x = _resize(x, (height, width), settings)
    # Normalise on planar float32 [T, C, H, W] (contiguous, vectorised: float(u8) - mean, / std,
    # the HF torchvision backend's operations in its order), then one strided copy into the patch
    # layout; a frame repeated to fill the last temporal patch is a stride-0 view, not a copy.
    # Videos go a few temporal patches at a time, so the float scratch stays small.
    t, channels = x.shape[0], x.shape[1]
    dest = torch.from_numpy(out).view(gt, gh // m, gw // m, m, m, channels, tps, p, p)
    mean, std = _norm_tensors(settings) if settings.do_normalize else (None, None)
    step = max(1, (1 << 22) // max(1, tps * channels * height * width))  # temporal patches per chunk
    scratch = torch.empty((min(t, step * tps), channels, height, width), dtype=torch.float32)
    for g0 in range(0, gt, step):
        g1 = min(gt, g0 + step)
        f0, f1 = g0 * tps, min(t, g1 * tps)
        planar = scratch[:f1 - f0]
        planar.copy_(x[f0:f1])
        if settings.do_normalize and settings.backend == "pil":
            planar.div_(1.0 / settings.rescale_factor).sub_(torch.tensor(settings.image_mean).view(-1, 1, 1))
            planar.div_(torch.tensor(settings.image_std).view(-1, 1, 1))
        elif settings.do_normalize:
            planar.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        elif settings.do_rescale:
            planar.mul_(settings.rescale_factor)
        if pad := (g1 - g0) * tps - (f1 - f0):  # repeat the last frame up to a whole temporal patch
            planar = torch.cat((planar, planar[-1:].expand(pad, -1, -1, -1)), 0) if f1 - f0 > 1 \
                else planar.expand(tps, -1, -1, -1)
        # A size that is not a whole number of patches (SigLIP's 384 px in 14 px patches) keeps its
        # whole patches: the patch embedding's stride leaves the rest out.
        src = planar[..., :gh * p, :gw * p].reshape(g1 - g0, tps, channels, gh // m, m, p, gw // m, m, p)
        dest[g0:g1].copy_(src.permute(0, 3, 6, 4, 7, 2, 1, 5, 8))
    return gt, gh, gw
