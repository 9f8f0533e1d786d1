"""GLM-4.1V, GLM-4.6V-Flash, GLMGA, GLM-OCR and GLM-4.5V: variants of one family.

The first three share a vision tower and a decoder and differ in their processors: the
frame-sampling rule, the video timestamp format and the size limits (`processor`). GLM-OCR brings
its own tower and decoder with GLM-4.6V's processor; GLM-4.5V GLM-4.1V's processor and tower with a
mixture-of-experts decoder (`tower`, `decoder`). Each variant is a `Family`; which one serves a
checkpoint is read from its config's `model_type` and its video processor's class
(`detect_family`), never from a name a user types.
"""
import dataclasses
from functools import partial

from triton_vlm.families.base import Family, ProcessorRules, Prompt, patch_encoder_dims
from triton_vlm.families.glm4v.processor import (BEGIN_IMAGE, BEGIN_VIDEO, END_IMAGE, END_VIDEO, EOS_TOKENS,
                                                 GLMGA_VIDEO_SIZE_DEFAULT, IMAGE_SIZE_DEFAULT, IMAGE_TOKEN,
                                                 SPECIAL_TOKENS, VIDEO_SIZE_DEFAULT, VIDEO_TOKEN, expand_media,
                                                 resize_rule, sample_frames_glm4v, sample_frames_glm46v,
                                                 sample_frames_glmga, timestamp_glm4v, timestamp_seconds)

PROMPT = Prompt(
    image_placeholder=BEGIN_IMAGE + IMAGE_TOKEN + END_IMAGE,
    video_placeholder=BEGIN_VIDEO + VIDEO_TOKEN + END_VIDEO,
    special_tokens=SPECIAL_TOKENS,
    named_special_tokens={"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN},
    eos_tokens=EOS_TOKENS)


def _family(name: str, model_types: tuple[str, ...], video_processor: str, sample_frames, timestamp_text,
            video_sampler_keys: tuple[str, ...] = (), video_size_default: tuple[int, int] = VIDEO_SIZE_DEFAULT,
            tower: str = "Glm4vTower", decoder: str = "GLM4") -> Family:
    return Family(
        name=name,
        model_types=model_types,
        video_processor_types=(video_processor,),
        prompt=PROMPT,
        processor=ProcessorRules(
            sample_frames=sample_frames, default_video_fps=2.0, video_sampler_keys=video_sampler_keys,
            resize_rule=resize_rule, expand_media=partial(expand_media, timestamp_text=timestamp_text),
            image_size_default=IMAGE_SIZE_DEFAULT, video_size_default=video_size_default),
        encoder_dims=patch_encoder_dims,
        tower=f"triton_vlm.families.glm4v.tower:{tower}",
        decoder=f"triton_vlm.families.glm4v.decoder:{decoder}",
        demo="triton_vlm.families.glm4v.demo:DEMOS",
    )


# Released GLM-4.6V-Flash and GLMGA checkpoints may say `model_type: glm4v`; their video processor
# tells them apart.
GLM4V = _family("glm4v", ("glm4v",), "Glm4vVideoProcessor", sample_frames_glm4v, timestamp_glm4v, ("max_duration",))
GLM46V = _family("glm46v", ("glm46v", "glm4v"), "Glm46VVideoProcessor", sample_frames_glm46v, timestamp_seconds)
GLMGA = _family("glmga", ("glmga", "glm4v"), "GlmgaVideoProcessor", sample_frames_glmga, timestamp_seconds,
                video_size_default=GLMGA_VIDEO_SIZE_DEFAULT)
# GLM-OCR has no processor class of its own: its checkpoints ship GLM-4.6V's, and `model_type`
# alone picks the family. Its own tower (`GlmOcrTower`) and decoder (no q/k/v biases).
GLM_OCR = _family("glm_ocr", ("glm_ocr",), "Glm46VVideoProcessor", sample_frames_glm46v, timestamp_seconds,
                  tower="GlmOcrTower", decoder="GLM_OCR")
# GLM-4.5V: GLM-4.1V's processor (transformers maps `glm4v_moe` to `Glm4vProcessor`) and tower,
# a mixture-of-experts decoder.
GLM4V_MOE = dataclasses.replace(
    _family("glm4v_moe", ("glm4v_moe",), "Glm4vVideoProcessor", sample_frames_glm4v, timestamp_glm4v, ("max_duration",),
            decoder="GLM4V_MOE"),
    prompt=dataclasses.replace(PROMPT, tool_call_format="glm45"))  # GLM-4.5's tool calls

FAMILIES = (GLM4V, GLM46V, GLMGA, GLM_OCR, GLM4V_MOE)
