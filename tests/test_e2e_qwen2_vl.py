"""Qwen2-VL end to end: a real tritonserver on a tiny checkpoint whose configs hold only what
transformers' own classes write ("bare", tests/config_variants.py), checked against transformers in
the same run.

- `preprocess` equals `Qwen2VLProcessor` (input_ids, pixel_values and grid_thw rows in prompt
  order) and `get_rope_index` (positions and the rope delta) for images of several sizes, two
  images, text, videos and an image with a video. Its video processor has no rate of its own: every
  frame is taken, and a request's `fps` samples as `do_sample_frames=True, fps=...` does. Both
  position regimes: a short video (the text after it starts at max + 1) and a long one of small
  frames, whose temporal positions run past its spatial extent (transformers' text starts at
  start + max(h', w') and the rope delta follows).
- `vision_encoder` equals the model's tower on an image and a video.
- The ensemble's greedy tokens equal `generate` over gRPC (streamed and not) and HTTP generate,
  each request alone and all of them in flight at once.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.test_e2e import (assert_preprocess_equals_hf, concurrently, family_server, grpc_tokens, http_tokens,
                            infer_direct, media_values)
from triton_vlm.families.qwen2_5_vl import QWEN2_VL
from triton_vlm.media import samples

IMG, VID = QWEN2_VL.image_placeholder, QWEN2_VL.video_placeholder
IMAGE_LARGE = samples.image_bytes(640, 480)                        # past max_pixels: scaled down
IMAGE_SMALL = samples.image_bytes(200, 150, fmt="PNG", seed=1.0)
IMAGE_TALL = samples.image_bytes(90, 300, seed=2.0)
# transformers' video processor class sizes frames to at least 128 * 28 * 28 pixels: a 48 x 48 frame
# becomes 336 x 336, a 12 x 12 merged grid, which 32 frames (16 temporal steps) run past.
VIDEO = samples.video_bytes(seconds=2.0, fps=2, width=160, height=120)       # 4 frames, grid [2, 20, 28]
LONG_VIDEO = samples.video_bytes(seconds=8.0, fps=4, width=48, height=48)    # 32 frames, grid [16, 24, 24]
NEW_TOKENS = 12


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


# kind -> (prompt, images, videos, mm_options)
PROMPTS = {
    "image_large": (chat(IMG + "What is in the picture?"), [IMAGE_LARGE], [], None),
    "image_small": (chat(IMG + "Describe it."), [IMAGE_SMALL], [], None),
    "image_tall": (chat("Look: " + IMG + " what is it?"), [IMAGE_TALL], [], None),
    "two_images": (chat(IMG + "and" + IMG + "compare them."), [IMAGE_SMALL, IMAGE_LARGE], [], None),
    "text": (chat("Tell me about a red car on the road."), [], [], None),
    "video": (chat(VID + "What moves?"), [], [VIDEO], None),
    "long_video": (chat(VID + "What happens?"), [], [LONG_VIDEO], None),
    "image_and_video": (chat(IMG + "then" + VID + "what changes?"), [IMAGE_SMALL], [VIDEO], None),
    "video_at_1fps": (chat(VID + "What moves?"), [], [LONG_VIDEO], {"fps": 1}),
}


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    """(running server, oracle) on the bare tiny checkpoint; the server is stopped after."""
    with family_server("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl"), "bare") as served:
        yield served


def hf_inputs(oracle, prompt, images, videos, mm_options) -> dict:
    """The processor's output, videos as the checkpoint's video processor takes them (every frame)
    unless the request gives a rate."""
    fps = (mm_options or {}).get("fps")
    return oracle.inputs(prompt, images, videos, fps=fps, sample=fps is not None)


@pytest.fixture(scope="module")
def expected(qwen2_vl) -> dict:
    """transformers' inputs, positions, rope delta and greedy tokens of every prompt, once."""
    _, oracle = qwen2_vl
    table = {}
    for kind, (prompt, images, videos, mm_options) in PROMPTS.items():
        inputs = hf_inputs(oracle, prompt, images, videos, mm_options)
        positions, delta = oracle.rope_index(inputs)
        table[kind] = dict(inputs=inputs, positions=positions, delta=delta,
                           tokens=oracle.generate(inputs, NEW_TOKENS))
    return table


@pytest.mark.parametrize("kind", PROMPTS)
def test_preprocess_matches_hf_processor_and_rope_index(qwen2_vl, expected, kind):
    server, oracle = qwen2_vl
    assert_preprocess_equals_hf(server, oracle, media_values(*PROMPTS[kind]), expected[kind])


def test_videos_take_every_frame_and_a_rate_samples(expected):
    """No rate of its own: 4 and 32 frames whole (grid_t 2 and 16); at 1 fps, 8 of the 32."""
    grids = {kind: expected[kind]["inputs"]["video_grid_thw"].tolist() for kind in ("video", "long_video", "video_at_1fps")}
    assert grids == {"video": [[2, 20, 28]], "long_video": [[16, 24, 24]], "video_at_1fps": [[4, 24, 24]]}


def test_long_video_text_starts_at_the_spatial_extent(expected):
    """Both regimes of transformers' rule: after the short video the text starts at max + 1; after
    the long one (16 temporal steps, a 12 x 12 merged grid) at start + 12, below the video's last
    temporal position, and the rope delta is max + 1 - length all the same."""
    for kind, past_extent in (("video", False), ("long_video", True)):
        ids = expected[kind]["inputs"]["input_ids"][0].numpy()
        positions = expected[kind]["positions"]
        video = np.flatnonzero(expected[kind]["inputs"]["mm_token_type_ids"][0].numpy() == 2)
        first_after, video_max = video[-1] + 1, int(positions[:, video].max())
        start = int(positions[0, video[0]])
        assert (int(positions[0, first_after]) < video_max + 1) == past_extent
        t, h, w = expected[kind]["inputs"]["video_grid_thw"][0].tolist()
        assert int(positions[0, first_after]) == start + max(h, w) // 2
        assert expected[kind]["delta"] == int(positions.max()) + 1 - len(ids)


@pytest.mark.parametrize("kind", ["image_large", "video"])
def test_vision_encoder_matches_hf_tower(qwen2_vl, expected, kind):
    server, oracle = qwen2_vl
    inputs = expected[kind]["inputs"]
    key, grid_key = ("pixel_values", "image_grid_thw") if kind.startswith("image") else ("pixel_values_videos",
                                                                                          "video_grid_thw")
    pixel_values, grid_thw = inputs[key].numpy(), inputs[grid_key].numpy()
    out = infer_direct(server, "vision_encoder", {"pixel_values": (pixel_values, "FP32"), "grid_thw": (grid_thw, "INT64")},
                       ["embeddings"])["embeddings"]
    reference = oracle.vision(pixel_values, grid_thw)
    assert out.shape == reference.shape
    assert np.abs(out - reference).max() / np.abs(reference).max() <= 1e-4


TRANSPORTS = {
    "grpc-stream": lambda server, prompt, images, videos, options: grpc_tokens(
        server, prompt, images, videos, NEW_TOKENS, True, options),
    "grpc": lambda server, prompt, images, videos, options: grpc_tokens(
        server, prompt, images, videos, NEW_TOKENS, False, options),
    "http-generate": lambda server, prompt, images, videos, options: http_tokens(
        server, prompt, images, videos, NEW_TOKENS, options),
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", PROMPTS)
def test_greedy_tokens_equal_hf_generate(qwen2_vl, expected, kind, transport):
    server, _ = qwen2_vl
    assert TRANSPORTS[transport](server, *PROMPTS[kind]) == expected[kind]["tokens"]


def test_concurrent_requests_each_equal_alone(qwen2_vl, expected):
    """Every prompt over gRPC streaming and HTTP generate, all in flight at once (the encoder
    batches rows of several requests, the engine their prefill and decode): each gets `generate`'s
    tokens."""
    server, _ = qwen2_vl
    keys = [(kind, transport) for kind in PROMPTS for transport in ("grpc-stream", "http-generate")]
    answers = concurrently(lambda key: TRANSPORTS[key[1]](server, *PROMPTS[key[0]]), keys)
    assert answers == {key: expected[key[0]]["tokens"] for key in keys}


def test_max_frames_without_a_rate_is_refused_naming_it(qwen2_vl):
    """Every frame is taken where no rate is given, so a `max_frames` alone could not be honoured:
    INVALID_ARG naming it, and the server keeps serving."""
    from tritonclient.utils import InferenceServerException

    server, _ = qwen2_vl
    prompt, images, videos, _ = PROMPTS["video"]
    with pytest.raises(InferenceServerException) as refused:
        infer_direct(server, "preprocess", media_values(prompt, images, videos, {"max_frames": 2}), ["input_ids"])
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "mm_options: max_frames does not apply" in refused.value.message()
    out = infer_direct(server, "preprocess", media_values(prompt, images, videos, {"num_frames": 2, "max_frames": 2}),
                       ["grid_thw"])
    assert out["grid_thw"].reshape(-1, 3)[:, 0].tolist() == [1]
