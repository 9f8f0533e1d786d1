"""InternVL end to end: the tiny demo checkpoint (its configs "varied": tests/config_variants.py; a
Qwen2 decoder, InternViT-300M's switches, at most 4 tiles) behind a real tritonserver, checked
against transformers in the same run: `preprocess` equals `InternVLProcessor` (ids, pixel rows,
one grid row per tile, thumbnail or frame), `vision_encoder` equals the model's own features, and
the ensemble's greedy `output_ids` equal `generate` for one tile, many tiles with a thumbnail, two
images, a video, an image beside a video and text, over gRPC streaming and HTTP generate, alone and
concurrently. The InternVL3.5-style checkpoint (a Qwen3 decoder, InternViT-6B's switches) runs the
same stages in this process (preprocess, the torch encoder, the engine) on one image.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from tests.oracle import Oracle, decode_frames
from tests.test_e2e import assert_served_tokens, family_server, infer_direct, media_values, served_concurrently
from triton_vlm.families.internvl.processor import IMAGE_TOKEN as IMG
from triton_vlm.families.internvl.processor import VIDEO_TOKEN as VID
from triton_vlm.families.llava.tower import patch_rows
from triton_vlm.media import samples

NEW_TOKENS = 8
VIDEO = samples.video_bytes(seconds=1.0, fps=5, width=96, height=64)


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def image(width: int, height: int, seed: float = 0.0) -> bytes:
    return samples.image_bytes(width, height, seed=seed)


PROMPTS = {
    "one-tile": (chat(IMG + "\nWhat is in the picture?"), [image(50, 60)], []),
    "tiles+thumbnail": (chat(IMG + "\nWhat is in the picture?"), [image(640, 480, 1.0)], []),
    "two-images": (chat(f"{IMG}\n{IMG}\nwhich is red?"), [image(200, 100, 2.0), image(90, 300, 3.0)], []),
    "video": (chat(VID + "\nWhat moves?"), [], [VIDEO]),
    "image+video": (chat(f"Look at {IMG}\nand{VID}\nSame colours?"), [image(300, 200, 4.0)], [VIDEO]),
    "text": (chat("Tell me about a red car on the road."), [], []),
}


def hf_inputs(oracle: Oracle, prompt: str, images: list[bytes], videos: list[bytes]) -> dict:
    """The processor's inputs: every video frame (the processor's default, as preprocess)."""
    from PIL import Image

    kwargs = {}
    if images:
        kwargs["images"] = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    if videos:
        kwargs["videos"] = [decode_frames(v)[0] for v in videos]
    return oracle.processor(text=[prompt], return_tensors="pt", **kwargs)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with family_server("internvl", tmp_path_factory.mktemp("internvl-e2e"), "varied") as served:
        yield served


def test_preprocess_matches_the_processor(served):
    server, oracle = served
    tiles = []
    for prompt, images, videos in PROMPTS.values():
        out = infer_direct(server, "preprocess", media_values(prompt, images, videos),
                           ["input_ids", "pixel_values", "grid_thw"])
        inputs = hf_inputs(oracle, prompt, images, videos)
        np.testing.assert_array_equal(out["input_ids"], inputs["input_ids"][0].numpy())
        if "pixel_values" not in inputs:
            assert out["grid_thw"].size == 0
            continue
        tiles.append(len(inputs["pixel_values"]))
        side = inputs["pixel_values"].shape[-1] // 14
        assert out["grid_thw"].reshape(-1, 3).tolist() == [[1, side, side]] * tiles[-1]
        np.testing.assert_array_equal(out["pixel_values"], patch_rows(inputs["pixel_values"].numpy(), 14))
    assert tiles[:2] == [1, 5]  # one tile; 2 x 2 tiles and the thumbnail


def test_vision_encoder_matches_the_model(served):
    server, oracle = served
    prompt, images, videos = PROMPTS["image+video"]
    pre = infer_direct(server, "preprocess", media_values(prompt, images, videos), ["pixel_values", "grid_thw"])
    out = infer_direct(server, "vision_encoder", {"pixel_values": (pre["pixel_values"], "FP32"),
                                                  "grid_thw": (pre["grid_thw"], "INT64")}, ["embeddings"])
    inputs = hf_inputs(oracle, prompt, images, videos)
    with torch.no_grad():
        ref = oracle.model.model.get_image_features(inputs["pixel_values"]).pooler_output
    ref = ref.reshape(-1, ref.shape[-1]).numpy()
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


def test_internvl3_5_style_checkpoint_equals_transformers(tmp_path):
    """Qwen3 decoder (q/k norms) and InternViT-6B's switches: ids, embedding rows, greedy tokens
    and logits of an image prompt equal transformers'."""
    from tests.test_config_variants import assert_pipeline_equals_hf
    from triton_vlm.families.demo import write_demo_checkpoint
    from triton_vlm.families.internvl.demo import VIT_6B

    checkpoint = write_demo_checkpoint("internvl", tmp_path, "tiny", overrides=dict(text_model="qwen3", vision=VIT_6B))
    assert_pipeline_equals_hf("internvl", checkpoint, Oracle(checkpoint))
