"""The `llm` model inside the session's tritonserver: custom metrics, cancellation, repetition penalty."""
from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.metrics import wait_for
from triton_vlm.clients.client import generate, grpc_inputs

PROMPT = "<|im_start|>user\nTell me about a red car on the road.<|im_end|>\n<|im_start|>assistant\n"


def direct_llm_inputs(hf, max_tokens: int) -> list:
    ids = hf.processor.tokenizer(PROMPT, return_tensors="np")["input_ids"][0].astype(np.int32)
    hidden = hf.model.config.text_config.hidden_size
    values = {"input_ids": (ids, "INT32"), "embeddings": (np.zeros((0, hidden), np.float32), "FP32"),
              "mrope_position_ids": (np.tile(np.arange(ids.size, dtype=np.int64), (3, 1)), "INT64"),
              "mrope_position_delta": (np.zeros(1, np.int64), "INT64"),
              "max_tokens": (np.array([max_tokens], np.int32), "INT32"), "stream": (np.array([True]), "BOOL")}
    return grpc_inputs(values)


def test_metrics_and_repetition_penalty(server, hf):
    before = wait_for(server, lambda v: "triton_vlm_llm_kv_blocks:free" in v)
    total = before["triton_vlm_llm_kv_blocks:free"] + before["triton_vlm_llm_kv_blocks:used"]
    assert total > 0
    inputs = hf.processor(text=[PROMPT], return_tensors="pt")
    expected = hf.model.generate(**inputs, max_new_tokens=12, do_sample=False, repetition_penalty=1.4)
    expected = expected[0, inputs["input_ids"].shape[1]:].tolist()
    result = generate(server.grpc_url, PROMPT, max_tokens=12, stream=True, repetition_penalty=1.4)
    assert result.output_ids == expected
    after = wait_for(server, lambda v: v.get("triton_vlm_llm_generated_tokens", 0)
                     >= before.get("triton_vlm_llm_generated_tokens", 0) + len(expected))
    assert after["triton_vlm_llm_generated_tokens"] >= before.get("triton_vlm_llm_generated_tokens", 0) + len(expected)
    assert after["triton_vlm_llm_kv_blocks:free"] == total and after["triton_vlm_llm_kv_blocks:used"] == 0
    assert after["triton_vlm_llm_requests:running"] == 0 and after["triton_vlm_llm_requests:waiting"] == 0


def test_cancel_direct_stream_frees_blocks_and_is_seen_in_metrics(server, hf):
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer("llm", direct_llm_inputs(hf, max_tokens=4000))
        first, error = responses.get(timeout=60)
        assert error is None and len(first.as_numpy("output_ids")) == 1
        busy = wait_for(server, lambda v: v.get("triton_vlm_llm_requests:running") == 1
                        and v.get("triton_vlm_llm_kv_blocks:used", 0) > 0)
        assert busy["triton_vlm_llm_requests:running"] == 1 and busy["triton_vlm_llm_kv_blocks:used"] > 0
        client.stop_stream(cancel_requests=True)
    idle = wait_for(server, lambda v: v.get("triton_vlm_llm_kv_blocks:used") == 0
                    and v.get("triton_vlm_llm_requests:running") == 0)
    assert idle["triton_vlm_llm_kv_blocks:used"] == 0 and idle["triton_vlm_llm_requests:running"] == 0


def test_over_context_is_invalid_arg(server, hf):
    from triton_vlm.clients.client import RequestError

    context = hf.model.config.text_config.max_position_embeddings
    with pytest.raises(RequestError, match=f"context is {context}"):
        generate(server.grpc_url, PROMPT, max_tokens=context)
