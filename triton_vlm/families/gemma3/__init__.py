"""Gemma 3 (transformers `gemma3`, `Gemma3ForConditionalGeneration`): a SigLIP tower on a square
resize, average-pooled to `mm_tokens_per_image` tokens, a (1 + w) RMSNorm and a projection
(`tower`), on the Gemma 3 decoder (`decoder`: 5 sliding-window layers to 1 full, each kind with its
own rotary, the tokens of one image attending to each other both ways in prefill). Its processor
(`processor`) expands each `<start_of_image>` in the text, optionally with pan-and-scan crops.
"""
from triton_vlm.families.base import Family, ProcessorRules, Prompt
from triton_vlm.families.gemma3 import processor as gemma3

GEMMA3 = Family(
    name="gemma3",
    model_types=("gemma3",),
    prompt=Prompt(image_placeholder=gemma3.BOI, video_placeholder="<video>",
                  special_tokens=(gemma3.PAD, gemma3.EOS, gemma3.BOS, gemma3.BOI, gemma3.EOI, gemma3.IMAGE_TOKEN,
                                  gemma3.START_OF_TURN, gemma3.END_OF_TURN),
                  named_special_tokens={"image_token": gemma3.IMAGE_TOKEN, "boi_token": gemma3.BOI,
                                        "eoi_token": gemma3.EOI},
                  eos_tokens=(gemma3.EOS, gemma3.END_OF_TURN),
                  image_placeholder_token=("boi_token", "boi_token_index")),
    processor=ProcessorRules(
        slice_rule=gemma3.slice_rule, expand_text=gemma3.expand_text,
        # One frame per view, patches in raster order; `Gemma3ImageProcessor`'s own defaults.
        vision_defaults=dict(temporal_patch_size=1, merge_size=1, resample=2, resize_to=(224, 224),
                             image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), num_image_tokens=256),
        # `Gemma3Processor`'s `images_kwargs`, which beat the saved config.
        processor_settings=dict(do_pan_and_scan=False, pan_and_scan_min_crop_size=256,
                                pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2),
        config_settings={"num_image_tokens": "mm_tokens_per_image"},
        image_flags=("do_pan_and_scan",), takes_videos=False, sized_by="the checkpoint's size"),
    encoder_dims=gemma3.encoder_dims,
    tower="triton_vlm.families.gemma3.tower:Gemma3Tower",
    decoder="triton_vlm.families.gemma3.decoder:GEMMA3_TEXT",
    demo="triton_vlm.families.gemma3.demo:DEMOS",
)

FAMILIES = (GEMMA3,)
