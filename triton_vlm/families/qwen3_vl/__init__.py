"""Qwen3-VL (`qwen3_vl`) and Qwen3-VL-MoE (`qwen3_vl_moe`): Qwen3-VL's processor rules
(`processor`), its tower with a learned position table and DeepStack mergers (`tower`), a Qwen3
decoder (dense or mixture of experts) with interleaved M-RoPE that adds the DeepStack maps after its
first layers (`decoder`), and their demo checkpoints (`demo`). The tower and the processor rules are
kept apart from the decoder, for the families built on them."""
from triton_vlm.contract.tensors import embedding_width
from triton_vlm.families.base import Family, ProcessorRules, Prompt, patch_encoder_dims
from triton_vlm.families.qwen3_vl.processor import (IMAGE_PAD, MAX_VIDEO_TOKENS, VIDEO_DEFAULTS, VIDEO_PAD,
                                                    VIDEO_SIZE_DEFAULT, VISION_END, VISION_START, expand_media,
                                                    resize_rule, sample_frames, video_cap)

# `Qwen3VLVisionConfig`'s default `deepstack_visual_indexes`.
DEEPSTACK_INDEXES = (8, 16, 24)

PROMPT = Prompt(
    image_placeholder=VISION_START + IMAGE_PAD + VISION_END,
    video_placeholder=VISION_START + VIDEO_PAD + VISION_END,
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD),
    named_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD,
                          "vision_start_token": VISION_START, "vision_end_token": VISION_END},
    eos_tokens=("<|im_end|>", "<|endoftext|>"), tool_call_format="hermes")

PROCESSOR = ProcessorRules(
    sample_frames=sample_frames, default_video_fps=2.0, resize_rule=resize_rule, expand_media=expand_media,
    processor_defaults={"Qwen3VLVideoProcessor": VIDEO_DEFAULTS}, video_size_default=VIDEO_SIZE_DEFAULT,
    video_cap=video_cap, max_video_tokens=MAX_VIDEO_TOKENS)


def encoder_dims(config: dict) -> tuple[int, int]:
    """A patch row's width, and an embedding row's: the text hidden size once for the input
    embedding and once per DeepStack map (`triton_vlm.contract.tensors.embedding_width`)."""
    patch_dim, hidden = patch_encoder_dims(config)
    maps = len(config["vision_config"].get("deepstack_visual_indexes", DEEPSTACK_INDEXES) or ())
    return patch_dim, embedding_width(hidden, maps)


def _family(name: str, decoder: str) -> Family:
    return Family(name=name, model_types=(name,), prompt=PROMPT, processor=PROCESSOR, encoder_dims=encoder_dims,
                  tower="triton_vlm.families.qwen3_vl.tower:Qwen3VLTower",
                  decoder=f"triton_vlm.families.qwen3_vl.decoder:{decoder}",
                  demo="triton_vlm.families.qwen3_vl.demo:DEMOS")


QWEN3_VL = _family("qwen3_vl", "QWEN3_VL")
QWEN3_VL_MOE = _family("qwen3_vl_moe", "QWEN3_VL_MOE")

FAMILIES = (QWEN3_VL, QWEN3_VL_MOE)
