"""LLaVA and LLaVA-OneVision: a CLIP or SigLIP tower with LLaVA's projector (`tower`) on a Llama or
Qwen2 decoder with 1-D RoPE (`decoder`). LLaVA's processor resizes and crops one view of each image
(`processor`); LLaVA-OneVision's adds anyres tiles, several-image padding and videos
(`onevision`), whose rows the tower unpads, cuts, pools and ends with newlines (`onevision_tower`,
`anyres`: numpy, which the encoder front counts rows with).
"""
from triton_vlm.families.base import Family, ProcessorRules, Prompt
from triton_vlm.families.llava import onevision as ov
from triton_vlm.families.llava import processor as llava

DEMOS = "triton_vlm.families.llava.demo:DEMOS"

LLAVA = Family(
    name="llava",
    model_types=("llava",),
    prompt=Prompt(image_placeholder=llava.IMAGE_TOKEN, video_placeholder=llava.VIDEO_TOKEN,
                  special_tokens=(llava.PAD, llava.BOS, llava.EOS, llava.IMAGE_TOKEN),
                  named_special_tokens={"image_token": llava.IMAGE_TOKEN}, eos_tokens=(llava.EOS,)),
    processor=ProcessorRules(
        resize_rule=llava.resize_rule, expand_media=llava.expand_media,
        # One frame per item, patches in raster order (no temporal patches, no merge blocks).
        vision_defaults=dict(temporal_patch_size=1, merge_size=1),
        # The image processor classes' own sizes and crop, where a config leaves them out.
        processor_defaults={"CLIPImageProcessor": dict(shortest_edge=224, do_center_crop=True, crop_size=(224, 224)),
                            "SiglipImageProcessor": dict(resize_to=(224, 224), image_mean=(0.5, 0.5, 0.5),
                                                         image_std=(0.5, 0.5, 0.5))},
        takes_videos=False, sized_by="the checkpoint's size and crop_size"),
    encoder_dims=llava.encoder_dims,
    tower="triton_vlm.families.llava.tower:LlavaTower",
    decoder={"llama": "triton_vlm.families.llava.decoder:LLAVA_LLAMA",
             "qwen2": "triton_vlm.families.llava.decoder:LLAVA_QWEN2"},
    demo=DEMOS,
)
LLAVA_ONEVISION = Family(
    name="llava_onevision",
    model_types=("llava_onevision",),
    prompt=Prompt(image_placeholder=ov.IMAGE_TOKEN, video_placeholder=ov.VIDEO_TOKEN,
                  special_tokens=(ov.PAD, ov.IM_START, ov.EOS, ov.IMAGE_TOKEN, ov.VIDEO_TOKEN),
                  named_special_tokens={"image_token": ov.IMAGE_TOKEN, "video_token": ov.VIDEO_TOKEN},
                  eos_tokens=(ov.EOS,)),
    processor=ProcessorRules(
        slice_rule=ov.slice_rule, expand_media=ov.expand_media,
        vision_defaults=dict(temporal_patch_size=1, merge_size=1),
        # The processor classes' own sizes, where a config leaves them out.
        processor_defaults={
            "LlavaOnevisionImageProcessor": dict(resize_to=(384, 384), image_grid_pinpoints=ov.DEFAULT_PINPOINTS),
            "LlavaOnevisionVideoProcessor": dict(resize_to=(384, 384))},
        several_images_settings=dict(image_grid_pinpoints=(), pad_to_square=True),
        video_settings=dict(image_grid_pinpoints=()), pack_views=True, image_sizes=True,
        sized_by="the checkpoint's size and image_grid_pinpoints"),
    encoder_dims=llava.encoder_dims,
    tower="triton_vlm.families.llava.onevision_tower:LlavaOnevisionTower",
    decoder="triton_vlm.families.llava.decoder:LLAVA_ONEVISION_QWEN2",
    demo=DEMOS,
)

FAMILIES = (LLAVA, LLAVA_ONEVISION)
