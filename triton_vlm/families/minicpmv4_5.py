"""MiniCPM-V 4.5 (`model_type` `minicpmv`, config `version` 4.5; official remote code, which
transformers 5 lacks): a SigLIP-NaViT tower and `Resampler4_5` on a Qwen3 decoder.

Its oracle is the official code's golden set (`shared/reference/minicpmv4_5/`). Served so far: the
decoder (`triton_vlm.llm.model.QWEN3`: image rows replace the `<unk>` runs that the processor puts
between `<image>`/`<slice>` and their end tokens, the `image_bound` rows; 1-D positions) and the
images' preprocessing: a prompt's `(<image>./</image>)` (several tokens: found in the text) becomes
`slice_runs` of `image_feature_size` (`query_num`) `<unk>` each, the slices cut as MiniCPM-V 4.6
cuts them but with sides in whole patches (`downsample_mode` "resampler").
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from triton_vlm.families import minicpmv
from triton_vlm.families.base import Family, MediaLayout
from triton_vlm.mrope import MediaSpan

IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER = "(<image>./</image>)", "(<video>./</video>)"
UNK, ENDOFTEXT, IM_START, IM_END = "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
IMAGE_START, IMAGE_END = "<image>", "</image>"
SLICE_START, SLICE_END = "<slice>", "</slice>"
IMAGE_ID_START, IMAGE_ID_END = "<image_id>", "</image_id>"
SPECIAL_TOKENS = (ENDOFTEXT, UNK, IM_START, IM_END, IMAGE_START, IMAGE_END, SLICE_START, SLICE_END,
                  IMAGE_ID_START, IMAGE_ID_END)
NAMED_TOKENS = {"unk_token": UNK, "im_start": IMAGE_START, "im_end": IMAGE_END, "slice_start": SLICE_START,
                "slice_end": SLICE_END, "im_id_start": IMAGE_ID_START, "im_id_end": IMAGE_ID_END}


def expand_media(media: MediaLayout, token_id: Callable[[str], int],
                 encode: Callable[[list[str]], list[list[int]]]) -> tuple[np.ndarray, list[MediaSpan]]:
    """`MiniCPMVImageProcessor.get_slice_image_placeholder`: runs of `<unk>`."""
    return minicpmv.slice_runs(media, token_id(UNK), token_id, encode)


MAX_NUM_FRAMES, MAX_NUM_PACKING, TIME_SCALE = 180, 3, 0.1


def choose_frames(num_frames: int, fps: float, choose_fps: float = 3, force_packing: int | None = None
                  ) -> tuple[np.ndarray, list[list[int]]]:
    """The official "chat with video" `encode_video` (MiniCPM-V 4.5 README): `choose_fps` frames a
    second, uniformly, at most MAX_NUM_FRAMES (longer videos pack up to MAX_NUM_PACKING frames per
    group, or `force_packing`); each frame's temporal id is its time on a TIME_SCALE grid (nearest
    point of `arange(0, duration, TIME_SCALE)`, in its units). Returns the frame indices and the
    temporal ids grouped by packing."""
    duration = num_frames / fps
    if choose_fps * int(duration) <= MAX_NUM_FRAMES:
        packing = 1
        chosen = round(min(choose_fps, round(fps)) * min(MAX_NUM_FRAMES, duration))
    else:
        packing = math.ceil(duration * choose_fps / MAX_NUM_FRAMES)
        if packing <= MAX_NUM_PACKING:
            chosen = round(duration * choose_fps)
        else:
            chosen, packing = round(MAX_NUM_FRAMES * MAX_NUM_PACKING), MAX_NUM_PACKING
    gap = num_frames / chosen
    indices = np.array([int(i * gap + gap / 2) for i in range(chosen)], dtype=np.int64)
    if force_packing:
        packing = min(force_packing, MAX_NUM_PACKING)
    scale = np.arange(0, duration, TIME_SCALE)
    nearest = scale[np.abs(scale[None, :] - (indices / fps)[:, None]).argmin(axis=1)]
    ids = (nearest / TIME_SCALE).astype(np.int32).tolist()
    return indices, [ids[i:i + packing] for i in range(0, len(ids), packing)]


def encoder_dims(config: dict) -> tuple[int, int]:
    """A patch row holds 3 x 14 x 14 pixel values; the resampler's queries are the LLM's width."""
    return 3 * config["patch_size"] ** 2, config["hidden_size"]


MINICPMV4_5 = Family(
    name="minicpmv4_5",
    model_types=("minicpmv",),
    versions=("4.5",),
    image_placeholder=IMAGE_PLACEHOLDER,
    video_placeholder=VIDEO_PLACEHOLDER,
    special_tokens=SPECIAL_TOKENS,
    named_special_tokens=NAMED_TOKENS,
    encoder_dims=encoder_dims,
    tower="triton_vlm.vision.minicpmv4_5:MiniCPMV4_5Tower",
    decoder="triton_vlm.llm.model:QWEN3",
    eos_tokens=(IM_END, ENDOFTEXT),
    placeholders_in_text=True,
    takes_videos=False,
    slice_rule=minicpmv.slice_rule,
    expand_media=expand_media,
    vision_defaults=dict(temporal_patch_size=1, merge_size=1, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                         downsample_mode="resampler", backend="pil"),
)
