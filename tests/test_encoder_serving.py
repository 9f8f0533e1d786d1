"""The served vision encoder (issue #4): dynamic batching across requests and the embedding cache,
through a real tritonserver, checked against the Hugging Face vision tower in the same run.

The session `server` (default build options) shows the cache through the whole ensemble; a
second, encoder-only server (this module's, cache off) shows several requests' items in one
execution, each request getting its own rows back.
"""
from __future__ import annotations

import re
import threading
import urllib.request

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from tests.encoder_checks import encode, encoder_models, rel_err
from triton_vlm.clients.client import generate
from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL
from triton_vlm.media import samples


def metric(server, name: str, model: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    found = re.search(rf'^{name}{{[^}}]*model="{model}"[^}}]*}} ([0-9.e+-]+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def test_two_concurrent_requests_with_the_same_image_encode_it_once(server, hf):
    image = samples.image_bytes(320, 240, seed=41.0)  # used by no other test: not cached yet
    prompt = chat(QWEN2_5_VL.image_placeholder + "What is this?")
    before = {k: metric(server, f"triton_vlm_encoder_cache_{k}", "vision_encoder_batch") for k in ("hits", "misses")}
    answers = {}
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(
        i, generate(server.grpc_url, prompt, [image], [], max_tokens=4).output_ids)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    after = {k: metric(server, f"triton_vlm_encoder_cache_{k}", "vision_encoder_batch") for k in ("hits", "misses")}
    assert after["misses"] - before["misses"] == 1  # computed once ...
    assert after["hits"] - before["hits"] == 1      # ... and served twice
    inputs = hf.inputs(prompt, [image])
    assert answers[0] == answers[1] == hf.generate(inputs, 4)


def test_a_request_without_media_does_not_call_the_encoder(server, hf):
    prompt = chat("Say something.")
    before = [metric(server, "nv_inference_request_success", m) for m in ("preprocess", "vision_encoder", "llm")]
    answer = generate(server.grpc_url, prompt, [], [], max_tokens=4).output_ids
    after = [metric(server, "nv_inference_request_success", m) for m in ("preprocess", "vision_encoder", "llm")]
    assert [b - a for a, b in zip(before, after)] == [1, 0, 1]
    assert answer == hf.generate(hf.inputs(prompt, []), 4)


def test_cache_hit_is_bit_identical_and_equals_hf(server, hf):
    inputs = hf.inputs(chat(QWEN2_5_VL.image_placeholder), [samples.image_bytes(250, 330, seed=42.0)])
    pixels, grid = inputs["pixel_values"].numpy(), inputs["image_grid_thw"].numpy()
    hits = metric(server, "triton_vlm_encoder_cache_hits", "vision_encoder_batch")
    first = encode(server, pixels, grid)
    second = encode(server, pixels, grid)
    assert metric(server, "triton_vlm_encoder_cache_hits", "vision_encoder_batch") - hits == 1
    assert second.tobytes() == first.tobytes()
    assert rel_err(first, hf.vision(pixels, grid)) <= 1e-4
    # One pixel changed by one ulp is another item: computed, not served from the cache.
    misses = metric(server, "triton_vlm_encoder_cache_misses", "vision_encoder_batch")
    changed = pixels.copy()
    changed[0, 0] = np.nextafter(changed[0, 0], np.float32(np.inf))
    encode(server, changed, grid)
    assert metric(server, "triton_vlm_encoder_cache_misses", "vision_encoder_batch") - misses == 1


# ---------------------------------------------------------------------------------------------
# Encoder-only server: cache off, a batch as large as the test's requests together
# ---------------------------------------------------------------------------------------------

# The grid_thw of each concurrent request of the batching test.
BATCH_GRIDS = {"partial windows": [[1, 34, 46]], "image+video+image": [[1, 16, 16], [2, 8, 12], [1, 4, 6]],
               "video": [[2, 20, 28]], "same size as another": [[1, 16, 16]]}


@pytest.fixture(scope="module")
def batching_server(tiny_repo, tiny_checkpoint, tmp_path_factory):
    """The batched model's max_batch_size is exactly the rows of BATCH_GRIDS, so Triton's dynamic
    batcher runs them the moment the last request arrives, however late the threads start; the
    queue delay (a minute) only bounds a test that went wrong."""
    import json

    from triton_vlm.families import detect_family
    from triton_vlm.repository.configs import model_configs, write_config
    from triton_vlm.repository.options import BuildOptions
    from tests.servers import running
    from triton_vlm.server.tritonserver import TritonServer

    repo = encoder_models(tiny_repo, tmp_path_factory.mktemp("encoder_only") / "repository")
    rows = sum(int(np.prod(grid, axis=1).sum()) for grid in BATCH_GRIDS.values())
    options = BuildOptions(encoder_max_queue_delay_us=60_000_000, encoder_cache_bytes=0, encoder_max_batch_patches=rows)
    configs = model_configs(detect_family(tiny_checkpoint), json.loads((tiny_checkpoint / "config.json").read_text()),
                            options)
    write_config(configs["vision_encoder_batch"], repo / "vision_encoder_batch" / "config.pbtxt")
    with running(TritonServer(repo, log_file=tmp_path_factory.mktemp("logs") / "encoder_only.log")) as server:
        yield server


def test_items_of_concurrent_requests_run_in_one_execution_and_split_back(batching_server, hf, tiny_checkpoint):
    from triton_vlm.families.qwen2_5_vl.tower import Qwen2_5_VLTower

    width = Qwen2_5_VLTower.read_vision_config(tiny_checkpoint)["patch_dim"]
    rng = np.random.default_rng(5)
    cases = {k: (rng.standard_normal((int(np.prod(g, axis=1).sum()), width)).astype(np.float32),
                 np.array(g, dtype=np.int64)) for k, g in BATCH_GRIDS.items()}
    cases["no media"] = (np.zeros((0, width), np.float32), np.zeros((0, 3), np.int64))
    bad = (np.zeros((23, width), np.float32), np.array([[1, 4, 6]], np.int64))
    executions = metric(batching_server, "nv_inference_exec_count", "vision_encoder_batch")
    results, errors = {}, {}

    def run(name, pixels, grid):
        try:
            results[name] = encode(batching_server, pixels, grid)
        except InferenceServerException as error:
            errors[name] = error

    threads = [threading.Thread(target=run, args=(k, *v)) for k, v in [*cases.items(), ("bad", bad)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    # Four requests with media, one Triton execution of the batched model (video frames included).
    assert metric(batching_server, "nv_inference_exec_count", "vision_encoder_batch") - executions == 1
    assert set(errors) == {"bad"} and errors["bad"].status() == "StatusCode.INVALID_ARGUMENT"
    assert "pixel_values: 23 rows" in errors["bad"].message()
    assert results["no media"].shape == (0, hf.model.config.vision_config.out_hidden_size)
    for name, (pixels, grid) in cases.items():
        if len(grid):
            assert rel_err(results[name], hf.vision(pixels, grid)) <= 1e-4, name
