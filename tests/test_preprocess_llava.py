"""Issue #28: LLaVA's `preprocess` against transformers' `LlavaProcessor` (`CLIPImageProcessor`, or
`SiglipImageProcessor` for one variant; torchvision backend) on the same random-weight
checkpoints, for the four tower variants the other LLaVA tests share (`VARIANTS`: CLIP and SigLIP
towers, one and three feature layers, both select strategies, Llama and Qwen2 decoders).

`input_ids` (each `<image>` expanded to the processor's count), `pixel_values` (bit for bit, as
rows: `patch_rows` of the processor's [B, 3, H, W]), the images' sizes (`grid_thw` = the cropped
size in patches) and the placeholder count per image (the processor's own
`_get_num_multimodal_tokens`) equal the processor's; positions are plain 0..S-1 on three rows,
delta 0. Videos and the size options are refused naming the family.
"""
from __future__ import annotations

import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from tests.oracle import Oracle
from triton_vlm.errors import InvalidInput
from triton_vlm.families.llava.processor import IMAGE_TOKEN as IMG
from triton_vlm.media import samples

# Demo checkpoint overrides (`triton_vlm.families.llava.demo.LLAVA_SIZES`, tiny: 112 px images, 14 px patches).
VARIANTS: dict[str, dict] = {
    "clip-llama": dict(),  # the tiny demo: CLIP, vision_feature_layer -2, "default"
    "clip-qwen2-3layers-full": dict(text_model="qwen2", vision_feature_layer=[0, -3, -1],
                                    vision_feature_select_strategy="full"),
    "siglip-qwen2-3layers-default": dict(vision_model="siglip_vision_model", text_model="qwen2",
                                         vision_feature_layer=[-1, 0, 1], vision_feature_select_strategy="default",
                                         image_processor="siglip"),
    "siglip-llama-full": dict(vision_model="siglip_vision_model", vision_feature_layer=-1,
                              vision_feature_select_strategy="full"),
}
SIZES = [(640, 480), (200, 100), (112, 112), (60, 300), (1920, 1080), (31, 17)]


def llava_checkpoint(variant: str, out):
    """The variant's tiny demo checkpoint with every 1-D vision and projector parameter moved off
    its initial value (transformers starts biases at zero and norm weights at one, which would hide
    a missing bias or norm), saved again."""
    import torch
    from transformers import AutoModelForImageTextToText

    from triton_vlm.families.demo import write_demo_checkpoint

    checkpoint = write_demo_checkpoint("llava", out, "tiny", overrides=VARIANTS[variant])
    model = AutoModelForImageTextToText.from_pretrained(checkpoint)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("vision_tower" in name or "multi_modal_projector" in name):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(checkpoint)
    return checkpoint


@pytest.fixture(scope="session")
def llava_checkpoints(tmp_path_factory) -> dict:
    return {v: llava_checkpoint(v, tmp_path_factory.mktemp(f"llava-{v}")) for v in VARIANTS}


def chat(text: str) -> str:
    return f"USER: {text} ASSISTANT:"


def image(width: int, height: int, seed: float = 0.0) -> bytes:
    return samples.image_bytes(width, height, seed=seed)


def hf_inputs(oracle: Oracle, prompt: str, images: list[bytes]) -> dict:
    from PIL import Image

    kwargs = {"images": [Image.open(io.BytesIO(b)).convert("RGB") for b in images]} if images else {}
    return oracle.processor(text=[prompt], return_tensors="pt", **kwargs)


def hf_rows(oracle: Oracle, inputs: dict) -> tuple[np.ndarray, np.ndarray]:
    """The processor's pixel_values as the contract's rows and grid_thw (no image: none)."""
    from triton_vlm.families.llava.tower import patch_rows

    p = oracle.processor.patch_size
    if "pixel_values" not in inputs:
        return np.zeros((0, 3 * p * p), np.float32), np.zeros((0, 3), np.int64)
    pixels = inputs["pixel_values"].numpy()
    grid = np.array([[1, pixels.shape[2] // p, pixels.shape[3] // p]] * pixels.shape[0], dtype=np.int64)
    return patch_rows(pixels, p), grid


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, llava_checkpoints):
    from triton_vlm.preprocessing.preprocessor import Preprocessor

    checkpoint = llava_checkpoints[request.param]
    return Preprocessor(checkpoint), Oracle(checkpoint)


def check(pre, oracle: Oracle, prompt: str, images: list[bytes]) -> None:
    out = pre(prompt, images)
    inputs = hf_inputs(oracle, prompt, images)
    np.testing.assert_array_equal(out.input_ids, inputs["input_ids"][0].numpy())
    pixels, grid = hf_rows(oracle, inputs)
    np.testing.assert_array_equal(out.grid_thw, grid)
    assert out.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(out.pixel_values, pixels)
    n = out.input_ids.shape[0]
    np.testing.assert_array_equal(out.mrope_position_ids, np.broadcast_to(np.arange(n), (3, n)))
    assert out.mrope_position_delta == 0


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_image_matches_llava_processor(case, size):
    pre, oracle = case
    check(pre, oracle, chat(IMG + "\nWhat is this?"), [image(*size)])


def test_several_images_match_llava_processor(case):
    pre, oracle = case
    images = [image(w, h, seed=float(i)) for i, (w, h) in enumerate(SIZES[:4])]
    check(pre, oracle, chat(f"{IMG} and {IMG}\nthen{IMG}{IMG} which?"), images)


def test_placeholder_count_is_the_processors(case):
    """Each image's run of `<image>` is the processor's (patches, the class token, the strategy),
    which is also the tower's embedding rows for its grid."""
    from triton_vlm.families.llava.tower import LlavaTower

    pre, oracle = case
    prompt, images = chat(IMG + " and " + IMG), [image(640, 480), image(90, 200)]
    out = pre(prompt, images)
    ids = hf_inputs(oracle, prompt, images)["input_ids"][0].numpy()
    is_image = np.concatenate([[0], (ids == pre.image_token_id).astype(np.int8), [0]])
    starts, ends = np.flatnonzero(np.diff(is_image) == 1), np.flatnonzero(np.diff(is_image) == -1)
    counts = (ends - starts).tolist()
    assert len(counts) == 2 and int((out.input_ids == pre.image_token_id).sum()) == sum(counts)
    settings = LlavaTower.read_vision_config(oracle.checkpoint)
    assert LlavaTower.embedding_rows(out.grid_thw, settings).tolist() == counts


def test_text_only_prompt(case):
    pre, oracle = case
    check(pre, oracle, chat("Tell me about a red car."), [])


def test_video_and_size_options_are_refused_naming_the_family(case):
    pre, _ = case
    with pytest.raises(InvalidInput, match=r"videos: this model \(llava\) takes no videos"):
        pre(chat("<video>"), [], [samples.video_bytes(seconds=1.0, fps=4, width=64, height=64)])
    with pytest.raises(InvalidInput, match="min_pixels does not apply: llava sizes images by the checkpoint's "
                                           "size and crop_size"):
        pre(chat(IMG), [image(64, 64)], mm_options={"min_pixels": 1000})


def test_extreme_aspect_ratio_is_refused(case):
    pre, _ = case
    with pytest.raises(InvalidInput, match=r"images\[0\]: aspect ratio 250.0 of 2000x8 exceeds max_aspect_ratio=200"):
        pre(chat(IMG), [image(2000, 8)])


def test_center_crop_pads_as_transformers_does():
    """A crop larger than the resized image (a processor config whose crop_size exceeds its
    shortest_edge) pads with zeros as transformers' torchvision backend does."""
    import torch
    from transformers import CLIPImageProcessor
    from transformers.image_utils import SizeDict

    from triton_vlm.media.frames import center_crop

    frames = np.random.default_rng(0).integers(0, 256, (1, 37, 52, 3), dtype=np.uint8)
    processor = CLIPImageProcessor()
    for crop in [(40, 40), (30, 60), (37, 52), (11, 13), (41, 55)]:
        chw = torch.from_numpy(frames).permute(0, 3, 1, 2)
        ref = processor.center_crop(chw, SizeDict(height=crop[0], width=crop[1]))
        np.testing.assert_array_equal(center_crop(frames, crop), ref.permute(0, 2, 3, 1).numpy())


def test_unsupported_processor_and_decoder_flags_are_refused(llava_checkpoints, tmp_path):
    """`LlavaImageProcessor`'s do_pad and Llama's attention_bias / mlp_bias are refused, not ignored."""
    import json
    import shutil

    from triton_vlm.llm import DecoderConfig
    from triton_vlm.preprocessing.preprocessor import Preprocessor

    checkpoint = shutil.copytree(llava_checkpoints["clip-llama"], tmp_path / "ckpt")
    processor = json.loads((checkpoint / "processor_config.json").read_text())
    processor["image_processor"]["do_pad"] = True
    (checkpoint / "processor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ValueError, match="do_pad"):
        Preprocessor(checkpoint).warmup()
    config = json.loads((checkpoint / "config.json").read_text())
    config["text_config"]["mlp_bias"] = True
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="llava: text_config mlp_bias is not supported"):
        DecoderConfig.from_checkpoint(checkpoint)
