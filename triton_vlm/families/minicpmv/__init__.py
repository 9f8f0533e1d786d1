"""MiniCPM-V: versions of one family that share slicing rules and prompt runs (`slicing`), SigLIP
towers and decoders (`decoder`). 4.6, 4.7 and MiniCPM-OCR are transformers' classes: a tower with
a window merger (`tower_v4_6`), each version's own rules in its module (`v4_6`, `v4_7` with
`canvas_mrope`, `ocr`). 2.0, 2.5, 2.6, 4.0 and 4.5 are the official remote code's `MiniCPMV`
(`model_type` `minicpmv`), which picks them by the config's `version` as vLLM's `MiniCPMV` does
(`remote_code.version`): the same processor and a resampler tower (`tower_resampler`; 2.0's timm
SigLIP, `tower_v2_0`), each on its own decoder (2.0: MiniCPM, 2.5: Llama 3, 2.6: Qwen2, 4.0: Llama
with LongRoPE, 4.5: Qwen3), 4.5 with videos (`v4_5`). A
version is a `Family`, picked by the checkpoint's `model_type` (and, for `minicpmv`, its version).
"""
import dataclasses

from triton_vlm.families.base import Family, ProcessorRules, Prompt
from triton_vlm.families.minicpmv import ocr, remote_code, v4_5, v4_6, v4_7
from triton_vlm.families.minicpmv.slicing import slice_rule

DEMOS = "triton_vlm.families.minicpmv.demo:DEMOS"

MINICPMV4_6 = Family(
    name="minicpmv4_6",
    model_types=("minicpmv4_6",),
    prompt=Prompt(image_placeholder=v4_6.IMAGE_TOKEN, video_placeholder=v4_6.VIDEO_TOKEN,
                  special_tokens=v4_6.SPECIAL_TOKENS, named_special_tokens=v4_6.NAMED_TOKENS,
                  eos_tokens=(v4_6.IM_END, v4_6.ENDOFTEXT), tool_call_format="hermes"),
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
# The official `MiniCPMV` versions. Their image processor numbers images only where its config
# says so (`use_image_id`; 4.5's keeps the setting it has always had here).
MINICPMV2_6 = remote_code.version(
    "minicpmv2_6", "2.6", special_tokens=v4_5.SPECIAL_TOKENS, eos_tokens=(remote_code.IM_END, v4_5.ENDOFTEXT),
    tool_call_format="hermes",
    tower="MiniCPMVTower", decoder="QWEN2", vision_defaults={**remote_code.VISION_DEFAULTS, "use_image_id": False})
MINICPMV4_0 = remote_code.version(
    "minicpmv4_0", "4.0", special_tokens=(remote_code.UNK, "<s>", "</s>", remote_code.IM_END, remote_code.IM_START,
                                          *remote_code.MARKERS),  # the official ids' order (the pad: id 0)
    eos_tokens=(remote_code.IM_END, "</s>"), tower="MiniCPMVTower", decoder="LLAMA",
    vision_defaults=MINICPMV2_6.processor.vision_defaults)
MINICPMV4_5 = remote_code.version(
    "minicpmv4_5", "4.5", special_tokens=v4_5.SPECIAL_TOKENS, eos_tokens=(remote_code.IM_END, v4_5.ENDOFTEXT),
    tool_call_format="hermes",
    tower="MiniCPMV4_5Tower", decoder="QWEN3", chat_template_kwargs=dict(enable_thinking=False),
    expand_media=v4_5.expand_media, sample_frames=v4_5.sample_frames, takes_videos=True,
    default_video_fps=3.0,  # the official chat's choose_fps
    pack_frames=v4_5.pack_frames, video_settings=dict(max_slice_nums=1, use_image_id=False))

# 2.0: the image processing lives in the official model code (`slice_image`), its settings in
# config.json; `chat()` takes one image and writes `<用户>` / `<AI>` turns (no template is shipped);
# 2.5's placeholders (a slice grid in one `<slice>`).
MINICPMV2_0 = remote_code.version(
    "minicpmv2_0", "2.0", special_tokens=(remote_code.UNK, "<s>", "</s>", *remote_code.MARKERS[:4], *remote_code.CHAT_2_0),
    eos_tokens=("</s>",), tower="triton_vlm.families.minicpmv.tower_v2_0:MiniCPMV2_0Tower", decoder="MINICPM",
    chat_template=remote_code.CHAT_2_0_TEMPLATE, max_images=1, demo="triton_vlm.families.minicpmv.demo_v2_0:DEMOS",
    config_settings={"image_feature_size": "query_num", "max_slice_nums": "max_slice_nums",
                     "scale_resolution": "scale_resolution", "patch_size": "patch_size", "slice_mode": "slice_mode"},
    vision_defaults={**remote_code.VISION_DEFAULTS, "use_image_id": False, "grid_in_one_slice": True})

# 2.5: Llama 3's tokens (its pad, id 0, is "!"; the demo's, `<|end_of_text|>`), a slice grid in one
# `<slice>`; every slice of a request padded to its largest in the tower (`padded_patches`).
MINICPMV2_5 = remote_code.version(
    "minicpmv2_5", "2.5", special_tokens=remote_code.LLAMA3_TOKENS, eos_tokens=remote_code.LLAMA3_EOS,
    tower="MiniCPMV2_5Tower", decoder="LLAMA3", padded_patches=True,
    vision_defaults={**remote_code.VISION_DEFAULTS, "use_image_id": False, "grid_in_one_slice": True})

FAMILIES = (MINICPMV4_6, MINICPMV4_5, MINICPMV2_6, MINICPMV4_0, MINICPMV2_5, MINICPMV4_7, MINICPM_OCR,
            MINICPMV2_0)
