"""The `llm` decoder in bfloat16 against transformers in bfloat16 (`from_pretrained(dtype=torch.bfloat16)`,
its default sdpa attention) for Qwen2.5-VL, GLM-4.1V, MiniCPM-V 4.6, LLaVA, Qwen3-VL (dense and MoE,
DeepStack maps added in bfloat16), Qwen3.5-MoE (its shared expert's sigmoid gate in bfloat16) and Gemma 3
(tiny checkpoints, perturbed as in tests/test_llm_minicpmv.py), on CPU and, marked `gpu`, on CUDA; the KV pool's
bytes per token
in bfloat16; and a `--llm-dtype bfloat16` build served by tritonserver.

Inputs come from each family's HF processor; vision rows from the bfloat16 HF model's own
`get_image_features` / `get_video_features` (sent as float32, as the `embeddings` tensor is;
the engine casts them back exactly); positions from its `get_rope_index` (1-D for MiniCPM-V).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from tests.metrics import wait_for
from tests.oracle import feature_rows
from tests.test_llm import hf_greedy_with_logits, llm_request, submit
from tests.test_llm_minicpmv import PROMPTS as MINICPMV_PROMPTS
from tests.test_llm_minicpmv import perturbed_checkpoint
from triton_vlm.clients.client import generate
from triton_vlm.llm import Engine, SamplingParams, prompt_logits

MAX_TOKENS = 24
# (chat template, image placeholder, video placeholder or None, text prompt)
FAMILIES = {
    "qwen2_5_vl": ("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
                   "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>",
                   "describe the red car on the road"),
    "glm4v": ("[gMASK]<sop><|user|>\n{}<|assistant|>\n", "<|begin_of_image|><|image|><|end_of_image|>",
              "<|begin_of_video|><|video|><|end_of_video|>", "describe the red car on the road"),
    "minicpmv4_6": ("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", "<|image_pad|>", None,
                    MINICPMV_PROMPTS["text"]),
    "llava": ("USER: {} ASSISTANT:", "<image>\n", None, "describe the red car on the road"),
    **{name: ("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", "<|vision_start|><|image_pad|><|vision_end|>",
              "<|vision_start|><|video_pad|><|vision_end|>", "describe the red car on the road")
       for name in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe")},
    "gemma3": ("<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n", "<start_of_image>", None,
               "describe the red car on the road, then the blue one"),
}
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def tolerance(ref: torch.Tensor, ulps: float = 1) -> float:
    """`ulps` bfloat16 ulps at the largest |logit| of `ref` (see test_prefill_logits_match_hf_bfloat16)."""
    return ulps * 2.0 ** -7 * float(ref.abs().max())


def ulps_on(engine: Engine) -> float:
    """The tolerance in ulps at the largest logit (see test_prefill_logits_match_hf_bfloat16): 1 on
    the CPU, 3 on CUDA."""
    return 3.0 if engine.model.device.type == "cuda" else 1.0


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """The family's tiny checkpoint, perturbed: the demo's norm weights are all one (or zero, for
    Qwen3.5's 1 + weight), and a weight of one scales the same on either side of a cast."""
    return request.param, perturbed_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module", params=DEVICES)
def bf16(request, checkpoint):
    """(HF bfloat16 model and engine on the device, per prompt: HF inputs and the llm's)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from transformers.video_utils import VideoMetadata

    device = request.param
    family, ckpt = checkpoint
    template, image_token, video_token, text = FAMILIES[family]
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.bfloat16).to(device).eval()
    processor = AutoProcessor.from_pretrained(ckpt)
    rng = np.random.default_rng(1)
    media = {"text": (text, {}),
             "image": (image_token + "what is in this image",
                       dict(images=[Image.fromarray(rng.integers(0, 256, (120, 200, 3), dtype=np.uint8))]))}
    if video_token:
        media["video"] = (video_token + "what is moving in the video", dict(
            videos=[rng.integers(0, 256, (20, 56, 56, 3), dtype=np.uint8)], do_sample_frames=True,
            video_metadata=[VideoMetadata(total_num_frames=20, fps=10, width=56, height=56)]))
    requests = {}
    for name, (prompt, kwargs) in media.items():
        inputs = processor(text=[template.format(prompt)], return_tensors="pt", **kwargs)
        on_device = {k: v.to(device) for k, v in inputs.items()}
        with torch.no_grad():
            rows = []
            if "pixel_values" in inputs:  # with the family's grid, if it has one (LLaVA's has none)
                grids = [on_device[k] for k in ("target_sizes", "image_grid_thw") if k in on_device]
                rows += feature_rows(model.model.get_image_features(on_device["pixel_values"], *grids))
            if "pixel_values_videos" in inputs:
                rows += feature_rows(model.model.get_video_features(on_device["pixel_values_videos"],
                                                                    on_device["video_grid_thw"]))
            pos = delta = None
            if hasattr(model.model, "get_rope_index"):  # M-RoPE (MiniCPM-V 4.6 and LLaVA: 1-D positions)
                pos, delta = (t.cpu() for t in model.model.get_rope_index(
                    on_device["input_ids"], mm_token_type_ids=on_device["mm_token_type_ids"],
                    image_grid_thw=on_device.get("image_grid_thw"), video_grid_thw=on_device.get("video_grid_thw"),
                    second_per_grid_ts=on_device.get("second_per_grid_ts")))
        assert bool(rows) == (name != "text")
        requests[name] = dict(llm_request(model, inputs, [r.float().cpu() for r in rows], pos, delta),
                              hf_inputs=on_device)
    engine = Engine(ckpt, device=device, dtype="bfloat16", return_logits=True)
    yield model, engine, requests
    engine.shutdown()


def test_prefill_logits_match_hf_bfloat16(bf16):
    """The last prompt position's logits within `tolerance` of transformers' bfloat16 forward.

    Measured: the engine mirrors transformers op for op in bfloat16 (weights rounded once, RMSNorm
    variance in float32 and the cast back where transformers casts, rotary cos/sin in float32 cast
    before they rotate, SDPA in bfloat16, the Gated DeltaNet's float32 islands, lm_head in bfloat16),
    and on CPU its logits are bitwise equal to transformers' for every family and prompt here (max
    |diff| 0, prefill and every greedy step; float16 too).

    Bound: bfloat16 keeps 8 significant bits, so its unit roundoff is 2^-8 and two neighbouring
    values at |z| are at most 2^-7 |z| apart. What may still differ is the order of float32
    accumulations (on CUDA: another GEMM tiling for the fused q/k/v and gate/up matmuls, another
    SDPA kernel for the masked decode batch); two orders of one sum round to the same bfloat16
    value or to neighbours, and a one-ulp flip of an intermediate element moves a logit by a
    fraction of one ulp at the logits' scale. So the tolerance is one ulp at the largest logit,
    2^-7 max|z|, which no logit's own ulp exceeds: about 0.015 to 0.022 here (max|z| 1.8 to 2.8).
    On CUDA three ulps: there the RMSNorms and rotaries are single kernels (`triton_vlm.llm.layers.cuda_ops`:
    the norm's sum of squares in another order, a multiply-add possibly fused) and prefill attention
    is SDPA's causal flash kernel where transformers passes a mask, on top of the GEMM tilings; the
    flips add up over the layers. Measured on an H100: up to 2.3 ulps (a Qwen2.5-VL video prompt).

    What it catches: on these perturbed checkpoints, a norm weight applied on the wrong side of
    its cast, rotary cos/sin computed in bfloat16 or RMSNorm statistics in bfloat16 move the
    logits by 1.4 to 11 times the tolerance (Qwen2.5-VL, GLM; MiniCPM-V's offset norms). A
    mistake confined to MiniCPM-V's one full-attention layer (its rotary) stays within it: a
    mistake that moves the logits by less than one rounding is not told apart from a kernel's
    reordering by any tolerance that holds on CUDA."""
    model, engine, requests = bf16
    for name, req in requests.items():
        with torch.no_grad():
            ref = model(**req["hf_inputs"]).logits[0, -1].float().cpu()
        llm = req["llm"]
        logits = prompt_logits(engine.model, torch.from_numpy(llm["input_ids"]), torch.from_numpy(llm["embeddings"]),
                                            torch.from_numpy(llm["mrope_position_ids"])).cpu()
        assert logits.dtype == torch.float32
        diff = float((logits - ref).abs().max())
        tol = tolerance(ref, ulps_on(engine))
        assert diff <= tol, f"{name}: max |diff| {diff:.3g} > {tol:.3g}"


def test_greedy_tokens_match_hf_bfloat16_generate(bf16):
    """Greedy tokens equal transformers' bfloat16 `generate` at every step, each step's logits
    within the tolerance, until a step where the tokens differ; there transformers' top-1 / top-2
    gap must be within 2 x `tolerance` (the two could swap places when each logit may be off by the
    tolerance; from there on the runs are not comparable). The tiny random models' logits are
    nearly flat (gaps of a few ulps are common), so the steps compared are counted: at least 8 over
    the family's prompts."""
    model, engine, requests = bf16
    assert greedy_steps_within_tolerance(model, engine, requests, ulps_on(engine)) >= 8


def greedy_steps_within_tolerance(model, engine, requests: dict, ulps: float = 1, max_tokens: int = MAX_TOKENS) -> int:
    """How many greedy steps of `engine` equal `model`'s `generate` (see
    test_greedy_tokens_match_hf_bfloat16_generate), each with its logits within `ulps`."""
    compared = 0
    for name, req in requests.items():
        expected, hf_logits = hf_greedy_with_logits(model, req, max_tokens)
        col = submit(engine, req, SamplingParams(max_tokens=max_tokens), f"bf16-{name}").wait()
        for step, (out, ref) in enumerate(zip(col.outputs, hf_logits)):
            ref = ref[0].float().cpu()
            tol = tolerance(ref, ulps)
            diff = float((out.logits - ref).abs().max())
            assert diff <= tol, f"{name} step {step}: max |diff| {diff:.3g} > {tol:.3g}"
            if out.token_ids != expected[step:step + 1]:
                top2 = ref.topk(2).values
                gap = float(top2[0] - top2[1])
                assert gap <= 2 * tol, f"{name} step {step}: another token with a top-2 gap of {gap:.3g}"
                break
            compared += 1
        else:
            assert col.ids == expected
    return compared


def test_bfloat16_pools(bf16):
    """The KV pool in bfloat16 on the model's device; the linear-attention conv state in bfloat16
    and its delta-rule state in float32, as transformers keeps them."""
    _, engine, _ = bf16
    assert engine.model.dtype == engine.runner.kv.k.dtype == engine.runner.kv.v.dtype == torch.bfloat16
    assert engine.runner.kv.k.device == engine.model.device
    if engine.config.recurrent:
        assert engine.runner.states.conv.dtype == torch.bfloat16
        assert engine.runner.states.recurrent.dtype == torch.float32


def test_kv_bytes_per_token_halve_in_bfloat16(tiny_checkpoint):
    """Same kv_cache_bytes: half the bytes per token, twice the tokens and blocks, the same bytes."""
    f32 = Engine(tiny_checkpoint, kv_cache_bytes=1 << 20)
    bf16 = Engine(tiny_checkpoint, kv_cache_bytes=1 << 20, dtype="bfloat16")
    try:
        assert f32.kv_bytes_per_token == 2 * bf16.kv_bytes_per_token
        assert (f32.runner.kv.k.dtype, bf16.runner.kv.k.dtype) == (torch.float32, torch.bfloat16)
        assert bf16.pool_tokens == 2 * f32.pool_tokens and bf16.blocks.num_blocks == 2 * f32.blocks.num_blocks
        assert bf16.runner.kv.nbytes == f32.runner.kv.nbytes == 1 << 20
    finally:
        f32.shutdown()
        bf16.shutdown()


# ---- a --llm-dtype bfloat16 build, served ---------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_server(tiny_checkpoint, tmp_path_factory):
    """tritonserver on `triton-vlm build --llm-dtype bfloat16` of the tiny Qwen2.5-VL checkpoint."""
    from tests.servers import running
    from triton_vlm.server.tritonserver import TritonServer
    from triton_vlm.tools.cli import main

    root = tmp_path_factory.mktemp("bf16-build")
    assert main(["build", "--checkpoint", str(tiny_checkpoint), "--repo", str(root / "repository"),
                 "--llm-dtype", "bfloat16", "--preprocess-instances", "1", "--encoder-frontends", "1"]) == 0
    with running(TritonServer(root / "repository", log_file=root / "tritonserver.log")) as server:
        yield server


def test_bfloat16_build_serves_the_engines_tokens_with_half_the_kv_bytes(bf16_server, server, tiny_checkpoint):
    """An image request through the bfloat16 server's ensemble gets the greedy tokens of the
    in-process bfloat16 Engine on the same inputs (that server's own preprocess and vision_encoder
    outputs); its KV bytes-per-token gauge is half the float32 session server's."""
    from tests.test_e2e import IMAGE_A, IMG, chat, infer_direct, media_values  # PyAV, tritonclient: not on GPU hosts

    prompt, images = chat(IMG + "What is in the picture?"), [IMAGE_A]
    pre = infer_direct(bf16_server, "preprocess", media_values(prompt, images, []),
                       ["input_ids", "pixel_values", "grid_thw", "mrope_position_ids", "mrope_position_delta"])
    embeddings = infer_direct(bf16_server, "vision_encoder", {"pixel_values": (pre["pixel_values"], "FP32"),
                                                              "grid_thw": (pre["grid_thw"], "INT64")},
                              ["embeddings"])["embeddings"]
    llm = {k: np.array(v) for k, v in dict(  # writable copies of the gRPC outputs
        input_ids=pre["input_ids"], embeddings=embeddings, mrope_position_ids=pre["mrope_position_ids"],
        mrope_position_delta=pre["mrope_position_delta"]).items()}
    engine = Engine(tiny_checkpoint, dtype="bfloat16")
    try:
        expected = submit(engine, {"llm": llm}, SamplingParams(max_tokens=16), "bf16-served").wait().ids
    finally:
        engine.shutdown()
    assert generate(bf16_server.grpc_url, prompt, images, max_tokens=16, stream=True).output_ids == expected

    name = "triton_vlm_llm_kv_bytes_per_token"
    served = wait_for(bf16_server, lambda v: name in v)[name]
    assert served == engine.kv_bytes_per_token
    assert 2 * served == wait_for(server, lambda v: name in v)[name]
