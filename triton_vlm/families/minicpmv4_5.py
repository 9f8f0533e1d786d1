"""MiniCPM-V 4.5 (`model_type` `minicpmv`, config `version` 4.5; official remote code, which
transformers 5 lacks): a SigLIP-NaViT tower and `Resampler4_5` on a Qwen3 decoder.

Its oracle is the official code's golden set (`shared/reference/minicpmv4_5/`). Served so far: the
decoder (`triton_vlm.llm.model.QWEN3`: image rows replace the `<unk>` runs that the processor puts
between `<image>`/`<slice>` and their end tokens, the `image_bound` rows; 1-D positions).
"""
from __future__ import annotations

from triton_vlm.families.base import Family

IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER = "(<image>./</image>)", "(<video>./</video>)"
UNK, ENDOFTEXT, IM_START, IM_END = "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
IMAGE_START, IMAGE_END = "<image>", "</image>"
SLICE_START, SLICE_END = "<slice>", "</slice>"
IMAGE_ID_START, IMAGE_ID_END = "<image_id>", "</image_id>"
SPECIAL_TOKENS = (ENDOFTEXT, UNK, IM_START, IM_END, IMAGE_START, IMAGE_END, SLICE_START, SLICE_END,
                  IMAGE_ID_START, IMAGE_ID_END)
NAMED_TOKENS = {"unk_token": UNK, "im_start": IMAGE_START, "im_end": IMAGE_END, "slice_start": SLICE_START,
                "slice_end": SLICE_END, "im_id_start": IMAGE_ID_START, "im_id_end": IMAGE_ID_END}


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
)
