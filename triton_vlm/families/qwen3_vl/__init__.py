"""Qwen3-VL (`qwen3_vl`) and Qwen3-VL-MoE (`qwen3_vl_moe`): Qwen3-VL's processor rules
(`processor`), its tower with a learned position table and DeepStack mergers (`tower`), a Qwen3
decoder (dense or mixture of experts) with interleaved M-RoPE that adds the DeepStack maps after its
first layers (`decoder`), and their demo checkpoints (`demo`). The tower and the processor rules are
kept apart from the decoder, for the families built on them.

Qwen3.5 (`qwen3_5`) and Qwen3.5-MoE (`qwen3_5_moe`): Qwen3-VL's processor and prompt, its tower
without DeepStack (`tower.Qwen3_5Tower`), and the Qwen3.5 hybrid decoder (`decoder.QWEN3_5`,
`QWEN3_5_MOE`)."""
from functools import partial

from triton_vlm.contract.tensors import embedding_width
from triton_vlm.families.base import Family, ProcessorRules, patch_encoder_dims
# Qwen2.5-VL's prompt: its placeholders, special tokens, eos and tool call format
from triton_vlm.families.qwen2_5_vl import PROMPT
from triton_vlm.families.qwen3_vl.processor import (MAX_VIDEO_TOKENS, VIDEO_DEFAULTS, VIDEO_SIZE_DEFAULT, expand_media,
                                                    resize_rule, sample_frames, video_cap)

# `Qwen3VLVisionConfig`'s default `deepstack_visual_indexes`.
DEEPSTACK_INDEXES = (8, 16, 24)

PROCESSOR = ProcessorRules(
    sample_frames=sample_frames, default_video_fps=2.0, resize_rule=resize_rule, expand_media=expand_media,
    processor_defaults={"Qwen3VLVideoProcessor": VIDEO_DEFAULTS}, video_size_default=VIDEO_SIZE_DEFAULT,
    video_cap=video_cap, max_video_tokens=MAX_VIDEO_TOKENS)


def encoder_dims(config: dict, deepstack_default: tuple[int, ...] = DEEPSTACK_INDEXES) -> tuple[int, int]:
    """A patch row's width, and an embedding row's: the text hidden size once for the input
    embedding and once per DeepStack map (`triton_vlm.contract.tensors.embedding_width`;
    `deepstack_default`: the vision config class's `deepstack_visual_indexes`)."""
    patch_dim, hidden = patch_encoder_dims(config)
    maps = len(config["vision_config"].get("deepstack_visual_indexes", deepstack_default) or ())
    return patch_dim, embedding_width(hidden, maps)


def _family(name: str, decoder: str, tower: str = "Qwen3VLTower", dims=encoder_dims) -> Family:
    return Family(name=name, model_types=(name,), prompt=PROMPT, processor=PROCESSOR, encoder_dims=dims,
                  tower=f"triton_vlm.families.qwen3_vl.tower:{tower}",
                  decoder=f"triton_vlm.families.qwen3_vl.decoder:{decoder}",
                  demo="triton_vlm.families.qwen3_vl.demo:DEMOS")


QWEN3_VL = _family("qwen3_vl", "QWEN3_VL")
QWEN3_VL_MOE = _family("qwen3_vl_moe", "QWEN3_VL_MOE")
# Qwen3.5's vision config has no DeepStack: its rows are the merger's output alone.
QWEN3_5 = _family("qwen3_5", "QWEN3_5", "Qwen3_5Tower", partial(encoder_dims, deepstack_default=()))
QWEN3_5_MOE = _family("qwen3_5_moe", "QWEN3_5_MOE", "Qwen3_5Tower", partial(encoder_dims, deepstack_default=()))

FAMILIES = (QWEN3_VL, QWEN3_VL_MOE, QWEN3_5, QWEN3_5_MOE)
