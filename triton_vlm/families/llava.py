"""LLaVA (transformers `llava`, `LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower
(`vision_config.model_type` `clip_vision_model` / `siglip_vision_model`), the hidden states of
`vision_feature_layer` (one index, or several concatenated in the order given) with the first
token dropped (`vision_feature_select_strategy` "default") or kept ("full"), the two-linear
`LlavaMultiModalProjector`, and a Llama or Qwen2 decoder (`text_config.model_type`) with 1-D RoPE.
Images only: a request with a video is refused (INVALID_ARG naming the family).

The prompt holds `<image>` once per image (the tokenizer's `image_token`); `preprocess` resizes
and crops each image as the checkpoint's `CLIPImageProcessor` does (torchvision backend: the
shorter side to `size.shortest_edge`, bicubic with antialias on uint8, the centre `crop_size`,
then the fused rescale + normalise), or a `SiglipImageProcessor` (resized to `size.height` x
`size.width`, no crop), and writes `<image>` as many times as `LlavaProcessor` does:
(height / patch) * (width / patch) + `num_additional_image_tokens`, less one with the "default"
strategy (the processor's own fields).

`preprocess` outputs (the contract's, for this family):

- `grid_thw`: one row `[1, h, w]` per image, `h, w` the crop's size in patches (every image of a
  checkpoint has the same: the tower's `image_size / patch_size` square), prompt order.
- `pixel_values`: float32 [N, 3 * patch * patch], one row per patch; an image's h * w patches in
  raster order (patch (y, x) at row y * w + x), each row the patch's pixels in (channel, dy, dx)
  order, the Conv2d `patch_embedding` weight's (in, kh, kw) order. transformers' `pixel_values`
  [B, 3, H, W] is the same values: `triton_vlm.vision.llava.patch_rows` turns one into the other.
- the vision_encoder's embeddings: per image h * w rows, plus one for a CLIP class token, less one
  with the "default" strategy (`extra_rows` in the tower settings), in token order (CLIP's class
  token first), each the projector's output.
- `mrope_position_ids`: the plain positions 0..S-1 on all three rows, `mrope_position_delta` 0:
  Llama and Qwen2 number the tokens in order (1-D RoPE); the llm turns every rotary frequency by
  the first row.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from triton_vlm.errors import InvalidInput
from triton_vlm.families.base import Family, MediaLayout
from triton_vlm.imaging import VisionSettings
from triton_vlm.mrope import MediaSpan

IMAGE_TOKEN, VIDEO_TOKEN = "<image>", "<video>"
PAD, BOS, EOS = "<pad>", "<s>", "</s>"


def encoder_dims(config: dict) -> tuple[int, int]:
    """(patch row width, embedding width): channels * patch^2 pixels, the text model's hidden size."""
    vision = config["vision_config"]
    return vision.get("num_channels", 3) * vision["patch_size"] ** 2, config["text_config"]["hidden_size"]


def resize_rule(height: int, width: int, settings: VisionSettings, num_frames: int, name: str) -> tuple[int, int]:
    """The torchvision backend's resize size: with `size.shortest_edge` (CLIP's processor),
    `get_resize_output_image_size(size=shortest_edge, default_to_square=False)`: the shorter side
    becomes `shortest_edge`, the longer `int(shortest_edge * long / short)` (the request limits have
    refused aspect ratios over 200 before: the longer side stays bounded); with `size.height` and
    `size.width` (SigLIP's), that size."""
    if settings.do_pad:  # (the preprocess model's warm-up meets this first: the model does not load)
        raise ValueError("LLaVA: the image processor's do_pad (padding to a square) is not supported")
    if height <= 0 or width <= 0:
        raise InvalidInput(f"{name}: image has no pixels")
    if settings.shortest_edge <= 0:
        if not all(settings.resize_to):
            raise ValueError("LLaVA: the image processor config has neither size.shortest_edge nor size.height "
                             "and size.width")
        return settings.resize_to
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = settings.shortest_edge, int(settings.shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def image_tokens(settings: VisionSettings, h: int, w: int) -> int:
    """`LlavaProcessor`'s placeholder count of an image of h x w patches."""
    return h * w + settings.num_additional_image_tokens - (settings.vision_feature_select_strategy == "default")


def expand_media(media: MediaLayout, token_id: Callable[[str], int],
                 encode: Callable[[list[str]], list[list[int]]]) -> tuple[np.ndarray, list[MediaSpan]]:
    """`<image>` repeated `image_tokens` times; no spans: image tokens take text positions."""
    n = sum(t * image_tokens(media.settings, h, w) for t, h, w in media.grids)
    return np.full(n, media.token, dtype=np.int32), []


LLAVA = Family(
    name="llava",
    model_types=("llava",),
    image_placeholder=IMAGE_TOKEN,
    video_placeholder=VIDEO_TOKEN,
    special_tokens=(PAD, BOS, EOS, IMAGE_TOKEN),
    named_special_tokens={"image_token": IMAGE_TOKEN},
    encoder_dims=encoder_dims,
    tower="triton_vlm.vision.llava:LlavaTower",
    decoder="",
    text_decoders={"llama": "triton_vlm.llm.decoders:LLAVA_LLAMA", "qwen2": "triton_vlm.llm.decoders:LLAVA_QWEN2"},
    eos_tokens=(EOS,),
    resize_rule=resize_rule,
    expand_media=expand_media,
    # One frame per item, patches in raster order (no temporal patches, no merge blocks).
    vision_defaults=dict(temporal_patch_size=1, merge_size=1),
    # The image processor classes' own sizes and crop, where a config leaves them out.
    processor_defaults={"CLIPImageProcessor": dict(shortest_edge=224, do_center_crop=True, crop_size=(224, 224)),
                        "SiglipImageProcessor": dict(resize_to=(224, 224), image_mean=(0.5, 0.5, 0.5),
                                                     image_std=(0.5, 0.5, 0.5))},
    takes_videos=False,
    sized_by="the checkpoint's size and crop_size",
)
