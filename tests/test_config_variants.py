"""Issue #39: every family exact on checkpoints whose configs are written as others write them.

- The defect: the M-RoPE layout is the text model's, whatever `mrope_interleaved` says: the code
  the server runs, in this process (`Preprocessor`, the family's tower as `TorchEncoder`, the
  module the ONNX export is traced from, and the `Engine`), against transformers on the same
  checkpoint: input ids, positions, the embedding rows its text model receives where the
  placeholders stand, the greedy tokens and every step's logits.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.oracle import Oracle, decode_frames
from triton_vlm import samples
from triton_vlm.families import FAMILIES

NEW_TOKENS = 6
IMAGE = samples.image_bytes(200, 150)
VIDEO = samples.video_bytes(seconds=2.0, fps=4, width=280, height=200)


# transformers' GLM cannot generate from an image and a video in one prompt (its video mask also
# selects the image tokens): they go in prompts of their own.
MEDIA_APART = ("glm4v", "glm46v", "glmga", "glm_ocr", "glm4v_moe")


def requests(family: str) -> list[tuple[str, list[bytes], list[bytes]]]:
    """An image, a video where the family takes them, and text."""
    f = FAMILIES[family]
    image = (f.image_placeholder, [IMAGE], [])
    if not f.takes_videos:
        return [(image[0] + "what is it?", image[1], [])]
    video = (f.video_placeholder, [], [VIDEO])
    if family in MEDIA_APART:
        return [(image[0] + "what is it?", image[1], []), (video[0] + "what moves?", [], video[2])]
    return [(image[0] + "and" + video[0] + "what is it?", image[1], video[2])]


def hf_inputs(oracle: Oracle, family: str, prompt: str, images, videos) -> dict:
    """The processor's inputs, videos sampled as the server samples them: by the family's rule
    (the checkpoint's, else every frame where the family has none); Qwen2-VL's video processor
    samples only when given a rate, which the server takes from the checkpoint, else 2 fps."""
    import io

    from PIL import Image

    kwargs = {"images": [Image.open(io.BytesIO(b)).convert("RGB") for b in images]} if images else {}
    if videos:
        decoded = [decode_frames(v) for v in videos]
        kwargs.update(videos=[f for f, _ in decoded], video_metadata=[m for _, m in decoded])
        if FAMILIES[family].sample_frames is not None:
            kwargs["do_sample_frames"] = True
        if family == "qwen2_5_vl":
            kwargs["fps"] = oracle.processor.video_processor.fps or FAMILIES[family].default_video_fps
    return oracle.processor(text=[prompt], return_tensors="pt", **kwargs)


@torch.no_grad()
def hf_run(oracle: Oracle, family: str, prompt: str, images, videos) -> dict:
    """transformers on the request: the processor's ids, what its text model receives on the
    prompt (input embeddings, positions) and `generate`'s greedy tokens and logits."""
    inputs = hf_inputs(oracle, family, prompt, images, videos)
    seen = {}
    text_model = oracle.model.model.language_model
    hook = text_model.register_forward_pre_hook(lambda _m, _a, kwargs: seen.setdefault("prompt", kwargs) and None,
                                                with_kwargs=True)
    try:
        out = oracle.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
    finally:
        hook.remove()
    positions = seen["prompt"].get("position_ids")  # [S], [1, S] or (M-RoPE) [3 or 4, 1, S]
    if positions is not None:
        positions = positions.numpy().reshape(-1, positions.shape[-1])[-3:]
    return dict(input_ids=inputs["input_ids"][0].numpy(), embeds=seen["prompt"]["inputs_embeds"][0],
                positions=positions,
                tokens=out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), logits=out.logits)


def assert_prompt_equals_hf(want: dict, input_ids, positions, embeddings, placeholder_ids) -> None:
    """Ids and positions are transformers' (`hf_run`), and so is each embedding row its text model
    receives where the prompt's placeholders stand."""
    np.testing.assert_array_equal(input_ids, want["input_ids"])
    if want["positions"] is not None:
        np.testing.assert_array_equal(positions, np.broadcast_to(want["positions"], positions.shape))
    reference = want["embeds"][torch.from_numpy(np.isin(input_ids, placeholder_ids))].numpy()
    assert embeddings.shape == reference.shape
    assert np.abs(embeddings - reference).max() <= 1e-4 * max(1.0, np.abs(reference).max())


@torch.no_grad()
def assert_pipeline_equals_hf(family: str, checkpoint, oracle: Oracle) -> None:
    """Preprocess, encoder and engine in this process, as the server runs them, give transformers'
    ids, positions, embedding rows, greedy tokens and logits on each of the family's requests."""
    from tests.test_llm import Collector
    from triton_vlm.llm import DecoderConfig, Engine, SamplingParams
    from triton_vlm.preprocess import Preprocessor
    from triton_vlm.vision.torch_encoder import TorchEncoder

    preprocessor, encoder = Preprocessor(checkpoint), TorchEncoder(checkpoint)
    placeholder_ids = DecoderConfig.from_checkpoint(checkpoint).placeholder_token_ids
    engine = Engine(checkpoint, return_logits=True, kv_cache_tokens=2048)
    try:
        for i, (prompt, images, videos) in enumerate(requests(family)):
            want = hf_run(oracle, family, prompt, images, videos)
            out = preprocessor(prompt, images, videos)
            embeddings = encoder.encode(out.pixel_values, out.grid_thw,
                                        out.temporal_ids if out.temporal_ids.size else None,
                                        out.image_sizes if out.image_sizes.size else None)
            assert_prompt_equals_hf(want, out.input_ids, out.mrope_position_ids, embeddings, placeholder_ids)
            col = Collector()
            engine.submit(f"request-{i}", out.input_ids, embeddings, out.mrope_position_ids,
                          np.array([out.mrope_position_delta], np.int64), SamplingParams(max_tokens=NEW_TOKENS), col)
            col.wait()
            for ours, ref in zip(col.outputs, want["logits"]):
                assert torch.allclose(ours.logits, ref[0], atol=1e-4, rtol=0), (ours.logits - ref[0]).abs().max()
            assert col.ids == want["tokens"]
    finally:
        engine.shutdown()


# ---- the defect ---------------------------------------------------------------------------

# transformers' Qwen3.5 rotary always interleaves the M-RoPE frequencies and never reads
# `mrope_interleaved`; Qwen2.5-VL's and GLM's always lay them in runs. Our writer's checkpoints, the
# key as given here (None: left out), everything else as the writer wrote it. (MiniCPM-V 4.6's and
# MiniCPM-OCR's positions are equal on the three axes, so the layout cannot show there.)
MROPE_INTERLEAVED = [("minicpmv4_7", None), ("minicpmv4_7", False), ("minicpmv4_6", None), ("minicpm_ocr", False),
                     ("qwen2_5_vl", True), ("glm4v", True)]


@pytest.mark.parametrize("family, interleaved", MROPE_INTERLEAVED, ids=lambda v: str(v))
def test_the_mrope_layout_is_the_models_whatever_mrope_interleaved_says(family, interleaved, tmp_path):
    import json

    from triton_vlm.checkpoint import write_demo_checkpoint

    checkpoint = write_demo_checkpoint(family, tmp_path / "checkpoint", "tiny")
    config = json.loads((checkpoint / "config.json").read_text())
    rope = config["text_config"]["rope_parameters"]
    rope.pop("mrope_interleaved", None)
    if interleaved is not None:
        rope["mrope_interleaved"] = interleaved
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert_pipeline_equals_hf(family, checkpoint, Oracle(checkpoint))
