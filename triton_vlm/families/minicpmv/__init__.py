"""MiniCPM-V: versions of one family that share slicing rules and prompt runs (`slicing`), a
SigLIP tower with a window merger (4.6, 4.7, MiniCPM-OCR: `tower_v4_6`) or a resampler (4.5:
`tower_v4_5`), and decoders (`decoder`); each version's own rules are in its module (`v4_6`,
`v4_7` with `canvas_mrope`, `ocr`, `v4_5`). A version is a `Family`, picked by the checkpoint's
`model_type` (and, for `minicpmv`, its config `version`).
"""
import dataclasses

from triton_vlm.families.base import Family, ProcessorRules, Prompt
from triton_vlm.families.minicpmv import ocr, v4_5, v4_6, v4_7
from triton_vlm.families.minicpmv.slicing import slice_rule

DEMOS = "triton_vlm.families.minicpmv.demo:DEMOS"

MINICPMV4_6 = Family(
    name="minicpmv4_6",
    model_types=("minicpmv4_6",),
    prompt=Prompt(image_placeholder=v4_6.IMAGE_TOKEN, video_placeholder=v4_6.VIDEO_TOKEN,
                  special_tokens=v4_6.SPECIAL_TOKENS, named_special_tokens=v4_6.NAMED_TOKENS,
                  eos_tokens=(v4_6.IM_END, v4_6.ENDOFTEXT)),
    processor=ProcessorRules(
        slice_rule=slice_rule, sample_frames=v4_6.sample_frames, video_sampler_keys=("max_num_frames", "stack_frames"),
        expand_media=v4_6.expand_media,
        # Each frame is its own image (no temporal patches) and patches stay in raster order; the
        # processor's own class defaults for what its config leaves out.
        vision_defaults=dict(temporal_patch_size=1, merge_size=1, image_mean=(0.5, 0.5, 0.5),
                             image_std=(0.5, 0.5, 0.5))),
    encoder_dims=v4_6.encoder_dims,
    tower="triton_vlm.families.minicpmv.tower_v4_6:MiniCPMV4_6Tower",
    decoder="triton_vlm.families.minicpmv.decoder:QWEN3_5",
    demo=DEMOS,
)
# 4.6's tower, slicing and decoder with canvas M-RoPE.
MINICPMV4_7 = dataclasses.replace(
    MINICPMV4_6, name="minicpmv4_7", model_types=("minicpmv4_7",),
    processor=dataclasses.replace(MINICPMV4_6.processor, expand_media=v4_7.expand_media,
                                  prompt_positions=v4_7.prompt_positions))
# 4.6's model read in "4x", images sized by their glyphs.
MINICPM_OCR = dataclasses.replace(
    MINICPMV4_6, name="minicpm_ocr", model_types=("minicpm_ocr",),
    tower="triton_vlm.families.minicpmv.tower_v4_6:MiniCPMOcrTower",
    decoder="triton_vlm.families.minicpmv.decoder:QWEN3_5_TIED",
    processor=dataclasses.replace(MINICPMV4_6.processor, refine_layout=ocr.refine_layout,
                                  vision_defaults={**MINICPMV4_6.processor.vision_defaults, "downsample_mode": "4x"}))
MINICPMV4_5 = Family(
    name="minicpmv4_5",
    model_types=("minicpmv",),
    versions=("4.5",),
    prompt=Prompt(image_placeholder=v4_5.IMAGE_PLACEHOLDER, video_placeholder=v4_5.VIDEO_PLACEHOLDER,
                  special_tokens=v4_5.SPECIAL_TOKENS, named_special_tokens=v4_5.NAMED_TOKENS,
                  eos_tokens=(v4_5.IM_END, v4_5.ENDOFTEXT), placeholders_in_text=True, chat_content_as_text=True,
                  chat_template_kwargs=dict(enable_thinking=False)),
    processor=ProcessorRules(
        slice_rule=slice_rule, expand_media=v4_5.expand_media, sample_frames=v4_5.sample_frames,
        default_video_fps=3.0,  # the official chat's choose_fps
        pack_frames=v4_5.pack_frames, video_settings=dict(max_slice_nums=1, use_image_id=False),
        vision_defaults=dict(temporal_patch_size=1, merge_size=1, image_mean=(0.5, 0.5, 0.5),
                             image_std=(0.5, 0.5, 0.5), downsample_mode="resampler", backend="pil")),
    encoder_dims=v4_5.encoder_dims,
    tower="triton_vlm.families.minicpmv.tower_v4_5:MiniCPMV4_5Tower",
    decoder="triton_vlm.families.minicpmv.decoder:QWEN3",
    demo=DEMOS,
)

FAMILIES = (MINICPMV4_6, MINICPMV4_5, MINICPMV4_7, MINICPM_OCR)
