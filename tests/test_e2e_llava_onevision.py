"""Issue #28 end to end: LLaVA-OneVision behind a real tritonserver on the tiny demo checkpoint
(its configs "varied": tests/config_variants.py), checked against transformers in the same run: `preprocess` equals `LlavaOnevisionProcessor` (ids,
pixel rows, grids, image sizes), `vision_encoder` equals the model's own features, and the
ensemble's greedy `output_ids` equal `generate` for one image, several images, a video, an image
beside a video and text, over gRPC streaming and HTTP generate, alone and concurrently.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from tests.oracle import decode_frames
from tests.test_e2e import assert_served_tokens, family_server, infer_direct, media_values, served_concurrently
from triton_vlm.families.llava.onevision import IMAGE_TOKEN as IMG
from triton_vlm.families.llava.onevision import VIDEO_TOKEN as VID
from triton_vlm.media import samples

NEW_TOKENS = 8
VIDEO = samples.video_bytes(seconds=1.0, fps=5, width=96, height=64)


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def image(width: int, height: int, seed: float = 0.0) -> bytes:
    return samples.image_bytes(width, height, seed=seed)


PROMPTS = {
    "image": (chat(IMG + "\nWhat is in the picture?"), [image(640, 480)], []),
    "images": (chat(f"{IMG} and {IMG}\nthen {IMG} which is red?"),
               [image(640, 480), image(200, 100, 1.0), image(90, 300, 2.0)], []),
    "video": (chat(VID + "\nWhat moves?"), [], [VIDEO]),
    "image+video": (chat(f"{IMG}\n{VID}\nSame colours?"), [image(300, 200, 3.0)], [VIDEO]),
    "text": (chat("Tell me about a red car on the road."), [], []),
}


def hf_inputs(oracle, prompt: str, images: list[bytes], videos: list[bytes]) -> dict:
    """The processor's inputs: the prompt's images as one sample, every video frame (the
    processor's default, as preprocess)."""
    from PIL import Image

    kwargs = {}
    if images:
        kwargs["images"] = [[Image.open(io.BytesIO(b)).convert("RGB") for b in images]]
    if videos:
        kwargs["videos"] = [decode_frames(v)[0] for v in videos]
    return oracle.processor(text=[prompt], return_tensors="pt", **kwargs)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with family_server("llava_onevision", tmp_path_factory.mktemp("llava-onevision-e2e"), "varied") as served:
        yield served


def test_preprocess_matches_the_processor(served):
    from triton_vlm.families.llava.tower import patch_rows

    server, oracle = served
    for prompt, images, videos in PROMPTS.values():
        out = infer_direct(server, "preprocess", media_values(prompt, images, videos),
                           ["input_ids", "pixel_values", "grid_thw", "image_sizes"])
        inputs = hf_inputs(oracle, prompt, images, videos)
        np.testing.assert_array_equal(out["input_ids"], inputs["input_ids"][0].numpy())
        grid = out["grid_thw"].reshape(-1, 3)
        rows = [patch_rows(inputs["pixel_values"][i, :t].numpy(), 14) for i, t in enumerate(grid[:len(images), 0])]
        rows += [patch_rows(v.numpy(), 14) for v in inputs.get("pixel_values_videos", [])]
        if rows:
            np.testing.assert_array_equal(out["pixel_values"], np.concatenate(rows))
        sizes = inputs["image_sizes"].numpy().tolist() if images else []
        assert out["image_sizes"].reshape(-1, 2).tolist() == sizes + [[0, 0]] * len(videos)


def test_vision_encoder_matches_the_model(served):
    server, oracle = served
    prompt, images, videos = PROMPTS["image+video"]
    pre = infer_direct(server, "preprocess", media_values(prompt, images, videos),
                       ["pixel_values", "grid_thw", "image_sizes"])
    out = infer_direct(server, "vision_encoder", {"pixel_values": (pre["pixel_values"], "FP32"),
                                                  "grid_thw": (pre["grid_thw"], "INT64"),
                                                  "image_sizes": (pre["image_sizes"], "INT64")}, ["embeddings"])
    inputs = hf_inputs(oracle, prompt, images, videos)
    with torch.no_grad():
        model = oracle.model.model
        ref = torch.cat([*model.get_image_features(inputs["pixel_values"], inputs["image_sizes"],
                                                   batch_num_images=inputs["batch_num_images"]).pooler_output,
                         model.get_video_features(inputs["pixel_values_videos"]).pooler_output.flatten(0, 1)]).numpy()
    assert out["embeddings"].shape == ref.shape
    assert np.abs(out["embeddings"] - ref).max() / np.abs(ref).max() <= 1e-4


@pytest.fixture(scope="module")
def expected_tokens(served) -> dict[str, list[int]]:
    _, oracle = served
    out = {}
    for kind, (prompt, images, videos) in PROMPTS.items():
        inputs = hf_inputs(oracle, prompt, images, videos)
        generated = oracle.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        out[kind] = generated[0, inputs["input_ids"].shape[1]:].tolist()
    return out


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_tokens_equal_hf_generate(served, expected_tokens, kind):
    server, _ = served
    assert_served_tokens(server, PROMPTS[kind], expected_tokens[kind], NEW_TOKENS)


def test_concurrent_requests_each_get_their_own_answer(served, expected_tokens):
    server, _ = served
    assert served_concurrently(server, PROMPTS, NEW_TOKENS) == expected_tokens
