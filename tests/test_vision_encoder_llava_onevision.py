"""Issue #28: LLaVA-OneVision's vision side (SigLIP tower, projector, then the unpadded tiles'
canvas, the anyres_max cut, the video pooling and the newlines as one gather) through the torch
back end and the ONNX Runtime export, against `LlavaOnevisionModel.get_image_features` /
`get_video_features` on the tiny demo checkpoint, inputs from `preprocess` (equal to the
processor's: `tests/test_preprocess_llava_onevision.py`). Error = max |ours - ref| / max |ref|:
within 1e-5 for torch, 1e-4 for ONNX Runtime.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.encoder_checks import rel_err
from tests.oracle import decode_frames
from tests.test_preprocess_llava_onevision import CASES, checkpoint, image, preprocessor, processor  # noqa: F401
from triton_vlm.errors import InvalidInput
from triton_vlm.families.llava.onevision import IMAGE_TOKEN as IMG
from triton_vlm.families.llava.onevision import VIDEO_TOKEN as VID
from triton_vlm.media import samples

VIDEO = dict(seconds=1.0, fps=5, width=96, height=64)


@pytest.fixture(scope="module")
def model(checkpoint):
    from transformers import LlavaOnevisionForConditionalGeneration

    return LlavaOnevisionForConditionalGeneration.from_pretrained(checkpoint).eval()


def cases(processor, preprocessor, model):
    """(name, preprocess output, transformers' features) per case: each image set of `CASES` as one
    prompt, a video, and an image beside a video."""
    out = []
    for sizes in CASES:
        pil, raw = zip(*[image(w, h, i) for i, (w, h) in enumerate(sizes)])
        ref = processor(text=[IMG * len(sizes)], images=[list(pil)], return_tensors="pt")
        with torch.no_grad():
            feats = model.model.get_image_features(ref["pixel_values"], ref["image_sizes"],
                                                   batch_num_images=ref["batch_num_images"]).pooler_output
        out.append(("+".join(f"{w}x{h}" for w, h in sizes), preprocessor(IMG * len(sizes), list(raw)),
                    torch.cat(list(feats)).numpy()))
    video = samples.video_bytes(**VIDEO)
    frames, _ = decode_frames(video)
    ref = processor(text=[VID], videos=[frames], return_tensors="pt")
    with torch.no_grad():
        feats = model.model.get_video_features(ref["pixel_values_videos"]).pooler_output.flatten(0, 1).numpy()
    out.append(("video", preprocessor(VID, [], [video]), feats))
    one = out[0]
    out.append(("image+video", preprocessor(IMG + VID, [image(640, 480, 0)[1]], [video]),
                np.concatenate([one[2], feats])))
    return out


@pytest.fixture(scope="module")
def all_cases(processor, preprocessor, model):
    return cases(processor, preprocessor, model)


def test_rows_per_item_equal_the_placeholders(all_cases, checkpoint, preprocessor):
    from triton_vlm.families.llava.onevision_tower import LlavaOnevisionTower

    settings = LlavaOnevisionTower.read_vision_config(checkpoint)
    for name, out, ref in all_cases:
        rows = LlavaOnevisionTower.embedding_rows(out.grid_thw, settings, out.extras)
        tokens = np.isin(out.input_ids, (preprocessor.image_token_id, preprocessor.video_token_id))
        assert int(rows.sum()) == len(ref) == int(tokens.sum()), name


def test_torch_back_end_matches_the_model(all_cases, checkpoint):
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    encoder = TorchEncoder(checkpoint, "cpu", "float32")
    for name, out, ref in all_cases:
        got = encoder.encode(out.pixel_values, out.grid_thw, out.extras)
        assert got.shape == ref.shape, name
        assert rel_err(got, ref) <= 1e-5, name


@pytest.mark.parametrize("max_patches_per_run", [8192, 25 * 10], ids=["one-run", "small-runs"])
def test_onnx_matches_the_model(all_cases, checkpoint, tmp_path_factory, max_patches_per_run):
    from triton_vlm.vision.runtime.encoder import VisionEncoder
    from triton_vlm.vision.runtime.export import export_onnx

    path = export_onnx(checkpoint, tmp_path_factory.mktemp("ov-onnx") / "encoder.onnx")
    encoder = VisionEncoder(path, max_patches_per_run=max_patches_per_run)
    for name, out, ref in all_cases:
        assert rel_err(encoder.encode(out.pixel_values, out.grid_thw, out.extras), ref) <= 1e-4, name


def test_image_sizes_checked(all_cases, checkpoint):
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    encoder = TorchEncoder(checkpoint, "cpu", "float32")
    _, out, _ = all_cases[0]
    with pytest.raises(InvalidInput, match="image_sizes: expected shape"):
        encoder.encode(out.pixel_values, out.grid_thw, {"image_sizes": np.zeros((2, 2), np.int64) + 5})
    with pytest.raises(InvalidInput, match="views"):
        encoder.encode(out.pixel_values, out.grid_thw, {"image_sizes": np.array([[70, 70]])})


def test_tensorrt_profile_bounds_every_case(all_cases, checkpoint):
    """The engine profile's gather rows (`profile_shapes`) hold every case's at its patch count."""
    from triton_vlm.families.llava.onevision_tower import LlavaOnevisionTower

    settings = LlavaOnevisionTower.read_vision_config(checkpoint)
    for name, out, ref in all_cases:
        patches = len(out.pixel_values)
        shapes = LlavaOnevisionTower.profile_shapes(settings, (1, patches, patches))
        assert shapes["feature_index"][0][0] <= len(ref) <= shapes["feature_index"][2][0], name
