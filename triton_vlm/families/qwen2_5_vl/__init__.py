"""Qwen2.5-VL: Qwen2-VL's processor rules (`processor`), its window-attention tower (`tower`), a
Qwen2 decoder with M-RoPE (`decoder`) and its demo checkpoint (`demo`)."""
from triton_vlm.families.base import Family, ProcessorRules, Prompt, patch_encoder_dims
from triton_vlm.families.qwen2_5_vl.processor import (IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, sample_frames,
                                                      video_t_factor)

QWEN2_5_VL = Family(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    prompt=Prompt(
        image_placeholder=VISION_START + IMAGE_PAD + VISION_END,
        video_placeholder=VISION_START + VIDEO_PAD + VISION_END,
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", VISION_START, VISION_END, IMAGE_PAD,
                        VIDEO_PAD),
        named_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD,
                              "vision_start_token": VISION_START, "vision_end_token": VISION_END},
        eos_tokens=("<|im_end|>", "<|endoftext|>"), tool_call_format="hermes"),
    processor=ProcessorRules(sample_frames=sample_frames, default_video_fps=2.0, video_t_factor=video_t_factor,
                             video_pruning=True),
    encoder_dims=patch_encoder_dims,
    tower="triton_vlm.families.qwen2_5_vl.tower:Qwen2_5_VLTower",
    decoder="triton_vlm.families.qwen2_5_vl.decoder:QWEN2",
    demo="triton_vlm.families.qwen2_5_vl.demo:DEMOS",
)

FAMILIES = (QWEN2_5_VL,)
