"""MiniCPM-V 2.0 end to end (`minicpmv2_0`: the official `MiniCPMV` class without a `version`, timm's
SigLIP so400m tower and the 2-D resampler on the MiniCPM-2.4B decoder) behind a real tritonserver,
served from the official golden checkpoint as it is (`tests/golden/minicpmv2_0`: the official remote
code under transformers 4.36.0, timm 0.9.10, torch 2.1.2; a SentencePiece tokenizer only): every
case's ids (`<s>` first, the `<用户>` / `<AI>` turns), image bounds, `tgt_sizes` and pixels, the
tower's position table, hidden state and rows (ONNX and torch), logits (MiniCPM's scalings) and
greedy tokens are the official ones, the text-only case too (`tests.minicpmv_golden.GoldenChecks`).
Also: a second image is refused naming the input (the official `chat()` takes one), the chat format
the server carries is the official `chat()`'s, and the demo checkpoint builds and serves."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from tests.minicpmv_golden import SETS, GoldenChecks, close, engine_tokens, pytest_generate_tests  # noqa: F401 (pytest's hook)
from tests.test_e2e import grpc_tokens, infer_direct, media_values

GOLDEN = SETS["minicpmv2_0"]


class TestMiniCPMV2_0(GoldenChecks):
    GOLDEN = GOLDEN

    def test_the_position_table_is_timms_resampled_one(self, preprocessed, tower):
        """`vision_pos_embed/0`: the 27 x 27 table resampled (bicubic, antialiased) to the first
        slice's patches, as the served preprocess sizes it."""
        tower_class, module, settings = tower
        grid = preprocessed["c_image_1500x500"]["grid_thw"][:1]
        metadata = tower_class.metadata(grid, settings)
        with torch.inference_mode():
            table = module.positions(torch.from_numpy(metadata["row_weights"]), torch.from_numpy(metadata["col_weights"]))
        close(table.numpy(), GOLDEN.values["c_image_1500x500/vision_pos_embed/0"])

    def test_a_second_image_is_invalid_arg_naming_it(self, server):
        """The official `chat()` takes one image: two are refused naming `images` and the limit, and
        the server goes on serving."""
        prompt, (image,), _ = GOLDEN.request("a_image_480x640")
        with pytest.raises(InferenceServerException) as refused:
            infer_direct(server, "preprocess", media_values(prompt + prompt, [image, image], []), ["input_ids"])
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert refused.value.message() == "images: 2 images exceed this model's 1 per prompt (minicpmv2_0)"
        assert grpc_tokens(server, prompt, [image], [], max_tokens=8) == GOLDEN.values["a_image_480x640/gen_tokens"].tolist()

    def test_the_chat_format_is_the_official_chats(self, server):
        """The ensemble carries the official `chat()`'s format (the checkpoint ships no template):
        every case's prompt is its message rendered through it, and a system message is refused."""
        import tritonclient.grpc as grpcclient

        from triton_vlm.clients.chat import render_chat
        from triton_vlm.families import detect_family

        client = grpcclient.InferenceServerClient(server.grpc_url)
        template = client.get_model_config("ensemble").config.parameters["chat_template"].string_value
        family = detect_family(GOLDEN.root)
        for case, c in GOLDEN.cases.items():
            parts = [{"type": "image"}] * len(c["media"]) + [{"type": "text", "text": c["chat"]["msgs"][0]["content"]}]
            assert render_chat(template, family, [{"role": "user", "content": parts}]) == c["prompt"], case
        with pytest.raises(Exception, match="user and assistant messages only"):
            render_chat(template, family, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])


def test_the_demo_checkpoint_builds_and_serves(tmp_path_factory):
    """`triton-vlm demo-checkpoint --family minicpmv2_0` writes the official layout (a SentencePiece
    model, no `version`, no processor config), detected as 2.0, which builds and serves: a sliced
    image answers as the pieces in process do (preprocess, the torch tower, the llm)."""
    import subprocess
    import sys

    from tests.servers import LEAN, served
    from triton_vlm.families import detect_family
    from triton_vlm.media import samples
    from triton_vlm.preprocessing.preprocessor import Preprocessor
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    checkpoint = tmp_path_factory.mktemp("minicpmv2_0-demo") / "checkpoint"
    subprocess.run([sys.executable, "-m", "triton_vlm.tools.cli", "demo-checkpoint", "--family", "minicpmv2_0",
                    "--out", str(checkpoint)], check=True, timeout=600)
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.model",
        "tokenizer_config.json"]
    assert "version" not in json.loads((checkpoint / "config.json").read_text())
    assert detect_family(checkpoint).name == "minicpmv2_0"
    prompt, images = "<用户>(<image>./</image>)\nWhat is in the picture?<AI>", [samples.image_bytes(300, 180)]
    with served(checkpoint, tmp_path_factory, "minicpmv2_0-demo-repo", LEAN) as server:
        tokens = grpc_tokens(server, prompt, images, [], max_tokens=6)
    out = Preprocessor(checkpoint)(prompt, images, [])
    assert len(out.grid_thw) > 1  # sliced
    rows = TorchEncoder(checkpoint).encode(out.pixel_values, out.grid_thw)
    assert tokens == engine_tokens(checkpoint, out.input_ids, rows, 6) and len(tokens) >= 1
