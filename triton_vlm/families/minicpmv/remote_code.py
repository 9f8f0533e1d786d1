"""The MiniCPM-V versions served from the official remote code's layout (its `MiniCPMV` class,
which transformers lacks; `model_type` `minicpmv`, told apart by the config's `version`: 2.0,
2.5, 2.6, 4.0, 4.5): what they share in their prompts and processor, and the `Family` of one
version (`version`).

The official processor (`MiniCPMVProcessor`, `MiniCPMVImageProcessor`; 2.0's model code) finds
`(<image>./</image>)` in the prompt's text and writes for each image `slice_runs` of
`image_feature_size` `<unk>` each, the slices cut by `slice_rule` (sides in whole patches:
`downsample_mode` "resampler"), pixels resized by Pillow (`backend` "pil"); the whole text is then
encoded with the tokenizer's own special tokens (4.0's Llama tokenizer puts `<s>` first, 2.5's
Llama 3 one `<|begin_of_text|>`). The resampler tower gives `query_num` rows per slice, which
replace the `<unk>` runs (`image_bound`); positions are 0..S-1. The official `chat()` joins a
message's parts by newlines before its chat template (`Prompt.chat_content_as_text`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from triton_vlm.families.base import Family, MediaLayout, ProcessorRules, Prompt
from triton_vlm.families.minicpmv.slicing import (IMAGE_END, IMAGE_ID_END, IMAGE_ID_START, IMAGE_START, SLICE_END,
                                                  SLICE_START, slice_rule, slice_runs)
from triton_vlm.media.mrope import MediaSpan

IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER = "(<image>./</image>)", "(<video>./</video>)"
UNK, IM_START, IM_END = "<unk>", "<|im_start|>", "<|im_end|>"
EOT = "<|eot_id|>"
# 2.5's Llama 3 tokenizer's special tokens (official ids' order, the eos first) and its markers.
LLAMA3_TOKENS = ("<|end_of_text|>", "<|begin_of_text|>", UNK, "<|start_header_id|>", "<|end_header_id|>", EOT,
                 IMAGE_START, IMAGE_END, SLICE_START, SLICE_END)
LLAMA3_EOS = ("<|end_of_text|>", EOT)  # the official `generate`'s terminators
MARKERS = (IMAGE_START, IMAGE_END, SLICE_START, SLICE_END, IMAGE_ID_START, IMAGE_ID_END)
NAMED_TOKENS = {"unk_token": UNK, "im_start": IMAGE_START, "im_end": IMAGE_END, "slice_start": SLICE_START,
                "slice_end": SLICE_END, "im_id_start": IMAGE_ID_START, "im_id_end": IMAGE_ID_END}
# 2.0's `chat()`: each message `<用户>` (user) or `<AI>` (assistant) + its content, then `<AI>`.
CHAT_2_0 = ("<用户>", "<AI>")
CHAT_2_0_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}<用户>{% elif message['role'] == 'assistant' %}"
    "<AI>{% else %}{{ raise_exception('MiniCPM-V 2.0 chat takes user and assistant messages only') }}{% endif %}"
    "{{ message['content'] }}{% endfor %}{% if add_generation_prompt %}<AI>{% endif %}")
# `MiniCPMVImageProcessor`'s pixels (one frame per item, patches in raster order) and what its
# class defaults where the config leaves a key out.
VISION_DEFAULTS: dict[str, Any] = dict(temporal_patch_size=1, merge_size=1, image_mean=(0.5, 0.5, 0.5),
                                       image_std=(0.5, 0.5, 0.5), downsample_mode="resampler", backend="pil")


def expand_images(media: MediaLayout, token_id: Callable[[str], int],
                  encode: Callable[[list[str]], list[list[int]]]) -> tuple[np.ndarray, list[MediaSpan]]:
    """`MiniCPMVImageProcessor.get_slice_image_placeholder`: runs of `<unk>`."""
    return slice_runs(media, token_id(UNK), token_id, encode)


def encoder_dims(config: dict) -> tuple[int, int]:
    """A patch row holds 3 x 14 x 14 pixel values; the resampler's queries are the LLM's width."""
    return 3 * config["patch_size"] ** 2, config["hidden_size"]


def config_version(config: dict) -> str:
    """The config's `version`; a config without one is 2.0's where vLLM's `MiniCPMV` takes it for
    2.0 (the real checkpoint's 2304-wide model with 64 queries) or where it has the keys only 2.0's
    config has (its timm tower's name, `vision_encoder`, and `scale_emb`). vLLM takes any other
    config without a version for 2.5, whose published config does say its version: refused."""
    if config.get("version") is not None:
        return str(config["version"])
    real = config.get("hidden_size") == 2304 and config.get("query_num") == 64
    return "2.0" if real or ("vision_encoder" in config and "scale_emb" in config) else "(none, and not 2.0's config)"


def version(name: str, served: str, *, special_tokens: tuple[str, ...], eos_tokens: tuple[str, ...],
            tower: str, decoder: str, chat_template_kwargs: dict[str, Any] | None = None,
            chat_template: str | None = None, demo: str = "triton_vlm.families.minicpmv.demo_remote_code:DEMOS",
            tool_call_format: str | None = None, **processor: Any) -> Family:
    """The `Family` of one version: its tokenizer's tokens (the first the pad token, as the demo
    trains them; the markers among them are its named ones), stop tokens (the official `chat`'s
    terminators), tower (a class of `tower_resampler`, or "module:class") and decoder, the
    variables its chat template is rendered with, and `ProcessorRules` over the shared ones."""
    rules = dict(slice_rule=slice_rule, expand_media=expand_images, vision_defaults=VISION_DEFAULTS,
                 takes_videos=False)
    return Family(
        name=name, model_types=("minicpmv",), versions=(served,), config_version=config_version,
        prompt=Prompt(image_placeholder=IMAGE_PLACEHOLDER, video_placeholder=VIDEO_PLACEHOLDER,
                      special_tokens=special_tokens, eos_tokens=eos_tokens,
                      named_special_tokens={k: t for k, t in NAMED_TOKENS.items() if t in special_tokens},
                      placeholders_in_text=True, chat_content_as_text=True,
                      chat_template_kwargs=chat_template_kwargs or {}, chat_template=chat_template,
                      tool_call_format=tool_call_format),
        processor=ProcessorRules(**{**rules, **processor}), encoder_dims=encoder_dims,
        tower=tower if ":" in tower else f"triton_vlm.families.minicpmv.tower_resampler:{tower}",
        decoder=f"triton_vlm.families.minicpmv.decoder:{decoder}", demo=demo)
