"""InternVL 3.x in transformers' format (`internvl`, `InternVLForConditionalGeneration`): InternViT
with a class token, a position table and per-channel layer scales (300M or 6B switches), pixel
shuffle 0.5 and an LN-MLP projector (`tower`), on a Qwen2 (InternVL3) or Qwen3 (InternVL3.5)
decoder with 1-D RoPE (`decoder`); GotOcr2's tiles plus a thumbnail, `<img>` wrappers and
"FrameN:" video lines (`processor`).
"""
from triton_vlm.families.base import Family, ProcessorRules, Prompt
from triton_vlm.families.internvl import processor as ivl

INTERNVL = Family(
    name="internvl",
    model_types=("internvl",),
    prompt=Prompt(image_placeholder=ivl.IMAGE_TOKEN, video_placeholder=ivl.VIDEO_TOKEN,
                  special_tokens=(ivl.PAD, ivl.IM_START, ivl.EOS, ivl.IMAGE_START, ivl.IMAGE_END, ivl.IMAGE_TOKEN,
                                  ivl.VIDEO_TOKEN),
                  # (`image_token`: what preprocess looks the placeholder up by; the processor reads the others)
                  named_special_tokens={"image_token": ivl.IMAGE_TOKEN, "start_image_token": ivl.IMAGE_START,
                                        "end_image_token": ivl.IMAGE_END, "context_image_token": ivl.IMAGE_TOKEN,
                                        "video_token": ivl.VIDEO_TOKEN},
                  eos_tokens=(ivl.EOS,), video_prefix=ivl.FIRST_FRAME),
    processor=ProcessorRules(
        slice_rule=ivl.slice_rule, expand_media=ivl.expand_media,
        # One frame per tile, patches in raster order (the tower's pixel shuffle joins 2 x 2 of them);
        # the classes' mean and std are CLIP's, the `VisionSettings` default.
        vision_defaults=dict(temporal_patch_size=1, merge_size=1),
        # The processor classes' own sizes, where a config leaves them out.
        processor_defaults={"GotOcr2ImageProcessor": dict(resize_to=(384, 384)),
                            "InternVLVideoProcessor": dict(resize_to=(384, 384))},
        # Video frames are not tiled: one tile each.
        video_settings=dict(min_patches=1, max_patches=1),
        sized_by="the checkpoint's size, min_patches and max_patches"),
    encoder_dims=ivl.encoder_dims,
    tower="triton_vlm.families.internvl.tower:InternVLTower",
    decoder={"qwen2": "triton_vlm.families.internvl.decoder:QWEN2",
             "qwen3": "triton_vlm.families.internvl.decoder:QWEN3"},
    demo="triton_vlm.families.internvl.demo:DEMOS",
)

FAMILIES = (INTERNVL,)
