"""Qwen2.5-VL and its predecessor Qwen2-VL: Qwen2-VL's processor rules (`processor`), their towers
(`tower`: window attention; `tower_qwen2_vl`: LayerNorm / quick-GELU blocks, no windows), a Qwen2
decoder with M-RoPE (`decoder`) and their demo checkpoints (`demo`).

What tells them apart is data: Qwen2-VL's video processor has no frame rate of its own (every frame
unless its config or the request says otherwise), its videos' temporal positions step by 1 (no
`second_per_grid_ts`), and its text after a media item starts where transformers' `get_rope_index`
puts it (`after_extent`)."""
from functools import partial

from triton_vlm.families.base import Family, ProcessorRules, Prompt, patch_encoder_dims
from triton_vlm.families.qwen2_5_vl.processor import (IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, sample_frames,
                                                      video_t_factor)
from triton_vlm.media.mrope import after_extent

PROMPT = Prompt(
    image_placeholder=VISION_START + IMAGE_PAD + VISION_END,
    video_placeholder=VISION_START + VIDEO_PAD + VISION_END,
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", VISION_START, VISION_END, IMAGE_PAD,
                    VIDEO_PAD),
    named_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD,
                          "vision_start_token": VISION_START, "vision_end_token": VISION_END},
    eos_tokens=("<|im_end|>", "<|endoftext|>"), tool_call_format="hermes")

QWEN2_5_VL = Family(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    prompt=PROMPT,
    processor=ProcessorRules(sample_frames=sample_frames, default_video_fps=2.0, video_t_factor=video_t_factor,
                             video_pruning=True),
    encoder_dims=patch_encoder_dims,
    tower="triton_vlm.families.qwen2_5_vl.tower:Qwen2_5_VLTower",
    decoder="triton_vlm.families.qwen2_5_vl.decoder:QWEN2",
    demo="triton_vlm.families.qwen2_5_vl.demo:DEMOS",
)

QWEN2_VL = Family(
    name="qwen2_vl",
    model_types=("qwen2_vl",),
    prompt=PROMPT,
    processor=ProcessorRules(sample_frames=sample_frames, default_video_fps=None, mrope_text_after=after_extent),
    encoder_dims=partial(patch_encoder_dims, out_key="hidden_size"),
    tower="triton_vlm.families.qwen2_5_vl.tower_qwen2_vl:Qwen2VLTower",
    decoder="triton_vlm.families.qwen2_5_vl.decoder:QWEN2",
    demo="triton_vlm.families.qwen2_5_vl.demo:DEMOS",
)

FAMILIES = (QWEN2_5_VL, QWEN2_VL)
