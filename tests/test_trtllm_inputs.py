"""tensorrtllm_backend's ensemble inputs and outputs through the session's tritonserver (the tiny
Qwen2.5-VL checkpoint), checked against transformers' `generate` with its own logits processors."""
from __future__ import annotations

import json
import queue

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

from triton_vlm.clients.client import RequestError, generate_payload, grpc_inputs, http_generate, request_values
from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL
from triton_vlm.media import samples

PROMPT = "<|im_start|>user\nTell me about a red car on the road.<|im_end|>\n<|im_start|>assistant\n"
IMAGE_PROMPT = ("<|im_start|>user\n" + QWEN2_5_VL.image_placeholder + "What is in the picture?<|im_end|>\n"
                "<|im_start|>assistant\n")
IMAGE = samples.image_bytes(320, 240)
N = 12


def tensor(value, datatype: str) -> tuple[np.ndarray, str]:
    dtype = {"BOOL": bool, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BYTES": np.object_}[datatype]
    values = value if isinstance(value, list) else [value]
    return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=dtype), datatype


# Every tensorrtllm_backend input the ensemble takes, each with a value it honours (as sent below).
TRTLLM_INPUTS = {
    "bad_words": tensor(["\x00never"], "BYTES"), "stop_words": tensor(["\x00never either"], "BYTES"),
    "exclude_input_in_output": tensor(True, "BOOL"), "end_id": tensor(2, "INT32"), "pad_id": tensor(0, "INT32"),
    "top_k": tensor(5, "INT32"), "top_p": tensor(0.9, "FP32"), "temperature": tensor(0.7, "FP32"),
    "length_penalty": tensor(1.0, "FP32"), "repetition_penalty": tensor(1.1, "FP32"), "min_tokens": tensor(4, "INT32"),
    "min_length": tensor(4, "INT32"), "presence_penalty": tensor(0.2, "FP32"), "frequency_penalty": tensor(0.1, "FP32"),
    "seed": tensor(9, "UINT64"), "random_seed": tensor(9, "UINT64"), "beam_width": tensor(1, "INT32"),
    "num_return_sequences": tensor(1, "INT32"), "return_log_probs": tensor(True, "BOOL"),
    "return_context_logits": tensor(False, "BOOL"), "return_generation_logits": tensor(False, "BOOL"),
    "return_perf_metrics": tensor(False, "BOOL"), "return_num_input_tokens": tensor(True, "BOOL"),
    "return_num_output_tokens": tensor(True, "BOOL"), "stream": tensor(True, "BOOL"),
    "guided_decoding_guide_type": tensor("regex", "BYTES"), "guided_decoding_guide": tensor("[a-z ]{1,80}", "BYTES"),
}


def stream(server, values: dict[str, tuple], model: str = "ensemble") -> list:
    """Every response with outputs (tritonclient InferResult) of one streamed request; RequestError
    with the server's message if it fails."""
    responses: queue.Queue = queue.Queue()
    results = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            client.async_stream_infer(model, grpc_inputs(values), enable_empty_final_response=True)
            while True:
                result, error = responses.get(timeout=300)
                if error is not None:
                    raise RequestError(error.message())
                if result.get_response().outputs:
                    results.append(result)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return results
        finally:
            client.stop_stream()


def output_ids(results: list) -> list[int]:
    return [int(i) for r in results for i in r.as_numpy("output_ids")]


def values(max_tokens: int = N, prompt: str = PROMPT, images=(), **extra) -> dict[str, tuple]:
    return {**request_values(prompt, images, max_tokens=max_tokens, stream=True), **extra}


@pytest.fixture(scope="module")
def hf_text(hf):
    return hf.inputs(PROMPT)


@torch.no_grad()
def hf_generate(hf, inputs, max_new_tokens: int = N, **kwargs):
    return hf.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


def new_tokens(inputs, out) -> list[int]:
    ids = out.sequences if hasattr(out, "sequences") else out
    return ids[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def greedy(hf, hf_text) -> list[int]:
    return new_tokens(hf_text, hf_generate(hf, hf_text))


def test_every_tensorrtllm_input_at_once(server):
    """One request with every input set, over gRPC streaming and HTTP generate: an answer of
    min_tokens..max_tokens tokens, with the log-probability and token-count outputs."""
    results = stream(server, values(**TRTLLM_INPUTS))
    ids = output_ids(results)
    assert 4 <= len(ids) <= N
    final = results[-1]
    assert final.as_numpy("finish_reason")[0] in (b"stop", b"length")
    assert int(final.as_numpy("num_output_tokens")[0]) == len(ids) and int(final.as_numpy("num_input_tokens")[0]) > 0
    assert sum(r.as_numpy("output_log_probs").shape[1] for r in results) == len(ids)
    body = {name: [v.decode() for v in value.tolist()] if datatype == "BYTES" else value.tolist()[0]
            for name, (value, datatype) in TRTLLM_INPUTS.items() if name != "stream"}
    (answer,) = http_generate(server.http_url, generate_payload(PROMPT, max_tokens=N, **body))
    assert answer["output_ids"] == ids and answer["num_output_tokens"] == len(ids)  # seeded: the same draws
    assert len(answer["output_log_probs"]) == len(ids)


def test_genai_perf_0_0_16_request(server):
    """What `genai-perf profile -m ensemble --endpoint-type kserve --backend tensorrtllm --streaming
    --output-tokens-mean 8 --output-tokens-mean-deterministic` sends (its TensorRTLLMConverter):
    text_input, max_tokens, exclude_input_in_output, stream and min_length: exactly 8 tokens."""
    inputs = {"text_input": tensor(PROMPT, "BYTES"), "max_tokens": tensor(8, "INT32"),
              "exclude_input_in_output": tensor(True, "BOOL"), "stream": tensor(True, "BOOL"),
              "min_length": tensor(8, "INT32")}
    results = stream(server, inputs)
    assert len(output_ids(results)) == 8 and results[-1].as_numpy("finish_reason")[0] == b"length"


def test_end_id_and_min_tokens_equal_hf_generate(server, hf, hf_text, greedy):
    """end_id: the request stops on that id (transformers' `eos_token_id`); min_tokens: not before
    that many tokens (transformers' `min_new_tokens`, MinNewTokensLengthLogitsProcessor)."""
    end_id = greedy[2]
    assert end_id not in greedy[:2]
    want = new_tokens(hf_text, hf_generate(hf, hf_text, eos_token_id=end_id))
    results = stream(server, values(end_id=tensor(end_id, "INT32")))
    assert output_ids(results) == want == greedy[:3]
    assert results[-1].as_numpy("finish_reason")[0] == b"stop"
    want = new_tokens(hf_text, hf_generate(hf, hf_text, eos_token_id=end_id, min_new_tokens=8))
    assert len(want) >= 8 and end_id not in want[:8]
    got = output_ids(stream(server, values(end_id=tensor(end_id, "INT32"), min_tokens=tensor(8, "INT32"))))
    assert got == want


@pytest.mark.parametrize("length", [1, 2])
def test_bad_words_equal_hf_no_bad_words(server, hf, hf_text, length):
    """A word of the greedy answer, banned: transformers' NoBadWordsLogitsProcessor on its tokens
    (tensorrtllm_backend tokenizes each word alone). The word: the first `length` tokens of the
    answer whose text tokenizes back to them (the tiny tokenizer's tokens are often bytes of a
    character)."""
    tokenizer = hf.processor.tokenizer
    greedy = new_tokens(hf_text, hf_generate(hf, hf_text, max_new_tokens=30))
    spans = [greedy[i:i + length] for i in range(len(greedy) - length + 1)]
    banned = next(ids for ids in spans if tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] == ids)
    word = tokenizer.decode(banned)
    want = new_tokens(hf_text, hf_generate(hf, hf_text, max_new_tokens=30, bad_words_ids=[banned]))
    assert want != greedy
    assert output_ids(stream(server, values(30, bad_words=tensor([word], "BYTES")))) == want


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence / frequency penalties over the generated ids (after the prompt)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.bincount(input_ids[0, self.prompt_len:], minlength=scores.shape[-1])[None].float()
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 2.0), (0.5, -0.5)])
def test_presence_and_frequency_penalties_equal_the_openai_formula(server, hf, hf_text, presence, frequency):
    processor = OpenAIPenalties(hf_text["input_ids"].shape[1], presence, frequency)
    want = new_tokens(hf_text, hf_generate(hf, hf_text, max_new_tokens=20,
                                           logits_processor=LogitsProcessorList([processor])))
    got = output_ids(stream(server, values(max_tokens=20, presence_penalty=tensor(presence, "FP32"),
                                           frequency_penalty=tensor(frequency, "FP32"))))
    assert got == want


@pytest.mark.parametrize("streamed", [True, False])
def test_log_probs_are_the_model_log_softmax(server, hf, hf_text, greedy, streamed):
    """Greedy: each token's log-probability is log_softmax of transformers' logits at that step;
    streamed, each response carries its own, and cum_log_probs the sum so far."""
    out = hf_generate(hf, hf_text, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits)[:, 0]
    want = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(greedy)[:, None])[:, 0].numpy()
    results = stream(server, values(return_log_probs=tensor(True, "BOOL"), stream=tensor(streamed, "BOOL")))
    assert output_ids(results) == greedy
    assert len(results) == (N if streamed else 1)
    got = np.concatenate([r.as_numpy("output_log_probs").reshape(-1) for r in results])
    np.testing.assert_allclose(got, want, atol=1e-4)
    cums = [float(r.as_numpy("cum_log_probs")[0]) for r in results]
    ends = np.cumsum([len(r.as_numpy("output_ids")) for r in results]) - 1
    np.testing.assert_allclose(cums, np.cumsum(want)[ends], atol=1e-3)
    assert results[0].as_numpy("output_log_probs").shape == (1, 1 if streamed else N)
    plain = stream(server, values())
    assert plain[-1].as_numpy("cum_log_probs") is None and plain[-1].as_numpy("output_log_probs") is None


@pytest.mark.parametrize("streamed", [True, False])
def test_top_log_probs_are_the_model_log_softmax(server, hf, hf_text, greedy, streamed):
    """`num_top_log_probs` k: each step's k most likely tokens and their log-probabilities,
    [1, tokens, k] per response, are the top k of log_softmax of transformers' logits there."""
    out = hf_generate(hf, hf_text, output_logits=True, return_dict_in_generate=True)
    best = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1).topk(3)
    results = stream(server, values(num_top_log_probs=tensor(3, "INT32"), stream=tensor(streamed, "BOOL")))
    assert output_ids(results) == greedy
    assert results[0].as_numpy("top_log_probs").shape == (1, 1 if streamed else N, 3)
    got = np.concatenate([r.as_numpy("top_log_probs")[0] for r in results])
    ids = np.concatenate([r.as_numpy("top_log_prob_ids")[0] for r in results])
    assert ids.tolist() == best.indices.tolist()
    np.testing.assert_allclose(got, best.values.numpy(), atol=1e-4)
    assert results[-1].as_numpy("output_log_probs") is None  # (not asked)


@pytest.mark.parametrize("streamed", [True, False])
def test_num_return_sequences_draw_as_their_seeds_in_one_request(server, streamed):
    """n sequences from one request, each response tagged with its `sequence_index`; the request
    ends once, after the last sequence. Sequence i of a request seeded s draws what a request
    seeded s + i draws."""
    sampled = dict(temperature=tensor(1.0, "FP32"), top_k=tensor(40, "INT32"), stream=tensor(streamed, "BOOL"))
    alone = [output_ids(stream(server, values(seed=tensor(30 + i, "UINT64"), **sampled))) for i in range(3)]
    assert len({tuple(a) for a in alone}) > 1
    results = stream(server, values(seed=tensor(30, "UINT64"), num_return_sequences=tensor(3, "INT32"), **sampled))
    by_index: dict[int, list] = {}
    for r in results:
        by_index.setdefault(int(r.as_numpy("sequence_index")[0]), []).append(r)
    assert [output_ids(by_index[i]) for i in range(3)] == alone
    assert all(by_index[i][-1].as_numpy("finish_reason")[0] in (b"stop", b"length") for i in range(3))
    if not streamed:
        assert [len(by_index[i]) for i in range(3)] == [1, 1, 1]


def test_num_input_tokens_is_the_expanded_prompt(server, hf):
    """The prompt's length with the image placeholder expanded (the HF processor's input_ids), on the
    final response only; with return_num_input_tokens false, not sent."""
    expanded = hf.inputs(IMAGE_PROMPT, [IMAGE])["input_ids"].shape[1]
    results = stream(server, values(4, IMAGE_PROMPT, [IMAGE]))
    unexpanded = len(hf.processor.tokenizer(IMAGE_PROMPT)["input_ids"])
    assert int(results[-1].as_numpy("num_input_tokens")[0]) == expanded > unexpanded
    assert int(results[-1].as_numpy("num_output_tokens")[0]) == 4
    assert all(r.as_numpy("num_input_tokens") is None for r in results[:-1])
    off = stream(server, values(4, return_num_input_tokens=tensor(False, "BOOL"),
                                return_num_output_tokens=tensor(False, "BOOL")))
    assert off[-1].as_numpy("num_input_tokens") is None and off[-1].as_numpy("num_output_tokens") is None


def test_random_seed_is_seed_and_accepted_values_change_nothing(server, greedy):
    sampled = dict(temperature=tensor(1.0, "FP32"), top_k=tensor(20, "INT32"))
    by_seed = output_ids(stream(server, values(seed=tensor(5, "UINT64"), **sampled)))
    assert output_ids(stream(server, values(random_seed=tensor(5, "UINT64"), **sampled))) == by_seed
    neutral = dict(exclude_input_in_output=tensor(True, "BOOL"), pad_id=tensor(0, "INT32"),
                   length_penalty=tensor(1.0, "FP32"), beam_width=tensor(1, "INT32"),
                   num_return_sequences=tensor(1, "INT32"), return_context_logits=tensor(False, "BOOL"))
    assert output_ids(stream(server, values(**neutral))) == greedy


REFUSED = {
    "exclude_input_in_output": (tensor(False, "BOOL"), "exclude_input_in_output: false is not supported"),
    "beam_width": (tensor(2, "INT32"), "beam_width: 2 is not supported (no beam search)"),
    "length_penalty": (tensor(0.8, "FP32"), "length_penalty: 0.8 is not supported"),
    "num_return_sequences": (tensor(0, "INT32"), "num_return_sequences: must be in [1, 16] "
                                                 "(max_return_sequences=16), got 0"),
    "num_top_log_probs": (tensor(-1, "INT32"), "num_top_log_probs: must be in [0, 20] (max_top_log_probs=20), got -1"),
    "return_context_logits": (tensor(True, "BOOL"), "return_context_logits: true is not supported"),
    "return_generation_logits": (tensor(True, "BOOL"), "return_generation_logits: true is not supported"),
    "return_perf_metrics": (tensor(True, "BOOL"), "return_perf_metrics: true is not supported"),
    "min_tokens": (tensor(N + 1, "INT32"), f"min_tokens: must be in [0, max_tokens={N}], got {N + 1}"),
    "min_length": (tensor(-2, "INT32"), f"min_length: must be in [0, max_tokens={N}], got -2"),
    "presence_penalty": (tensor(3.0, "FP32"), "presence_penalty: must be in [-2, 2], got 3.0"),
    "frequency_penalty": (tensor(-2.5, "FP32"), "frequency_penalty: must be in [-2, 2], got -2.5"),
    "end_id": (tensor(-1, "INT32"), "end_id: must be a token id >= 0, got -1"),
    "pad_id": (tensor(-1, "INT32"), "pad_id: must be a token id >= 0, got -1"),
    "bad_words": (tensor([""], "BYTES"), "bad_words[0]: must be a non-empty string"),
    "guided_decoding_guide_type": (tensor("xml", "BYTES"), "guided_decoding_guide_type: must be one of json, "
                                                           "json_schema, regex, ebnf_grammar, got 'xml'"),
    "guided_decoding_guide": (tensor("[a-z]+", "BYTES"), "guided_decoding_guide: given without "
                                                         "guided_decoding_guide_type"),
    "embedding_bias": (tensor([0.5, 0.5], "FP32"), "embedding_bias: 2 values; one per token of the model's vocabulary"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refusals_name_the_input(server, hf, name):
    """Refused by the ensemble before any step (gRPC streaming carries the message only; HTTP
    generate answers 400), and by the llm when called on its own."""
    value, message = REFUSED[name]
    with pytest.raises(RequestError) as error:
        stream(server, values(**{name: value}))
    assert message in str(error.value)
    first = value[0].tolist()[0]
    body = {name: [w.decode() for w in value[0].tolist()] if name == "bad_words" else value[0].tolist()
            if name == "embedding_bias" else first.decode() if isinstance(first, bytes) else first}
    with pytest.raises(RequestError) as error:
        http_generate(server.http_url, generate_payload(PROMPT, max_tokens=N, **body))
    assert "HTTP 400" in str(error.value) and message in str(error.value)
    ids = hf.processor.tokenizer(PROMPT)["input_ids"]
    direct = {"input_ids": (np.array(ids, np.int32), "INT32"),
              "embeddings": (np.zeros((0, hf.model.config.text_config.hidden_size), np.float32), "FP32"),
              "mrope_position_ids": (np.tile(np.arange(len(ids), dtype=np.int64), (3, 1)), "INT64"),
              "mrope_position_delta": (np.zeros(1, np.int64), "INT64"), "max_tokens": tensor(N, "INT32"), name: value}
    with pytest.raises(RequestError) as error:
        stream(server, direct, model="llm")
    assert message in str(error.value)


def test_guided_decoding_and_a_guide_that_does_not_compile(server):
    """A JSON schema honoured over gRPC and HTTP; one xgrammar cannot compile refused by the llm
    naming the input, and the server serves on."""
    import jsonschema

    schema = {"type": "object", "required": ["name", "color"],
              "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "color": {"enum": ["red", "blue"]}}}
    guide = dict(guided_decoding_guide_type=tensor("json_schema", "BYTES"),
                 guided_decoding_guide=tensor(json.dumps(schema), "BYTES"))
    results = stream(server, values(40, **guide))
    text = "".join(r.as_numpy("text_output")[0].decode() for r in results)
    jsonschema.validate(json.loads(text), schema)
    assert results[-1].as_numpy("finish_reason")[0] == b"stop"
    (answer,) = http_generate(server.http_url, generate_payload(PROMPT, max_tokens=40, guided_decoding_guide_type=
                                                                "json_schema", guided_decoding_guide=json.dumps(schema)))
    assert answer["output_ids"] == output_ids(results)
    message = "guided_decoding_guide: invalid JSON schema: properties must be an object"
    bad = dict(guide, guided_decoding_guide=tensor('{"type": "object", "properties": 5}', "BYTES"))
    with pytest.raises(RequestError, match=message):
        stream(server, values(**bad))
    with pytest.raises(RequestError, match=message):
        http_generate(server.http_url, generate_payload(PROMPT, max_tokens=N, guided_decoding_guide_type="json_schema",
                                                        guided_decoding_guide='{"type": "object", "properties": 5}'))
    assert output_ids(stream(server, values(40, **guide))) == output_ids(results)


def test_an_end_id_outside_the_vocabulary_is_refused_by_the_llm(server, hf):
    vocab = hf.model.config.text_config.vocab_size
    with pytest.raises(RequestError, match=rf"end_id: must be a token id in \[0, {vocab}\), got {vocab}"):
        stream(server, values(end_id=tensor(vocab, "INT32")))


def test_a_tensorrtllm_input_we_do_not_take_is_refused_by_triton_naming_it(server):
    with pytest.raises(RequestError, match="lora_task_id"):
        stream(server, values(lora_task_id=tensor(1, "UINT64")))


def test_a_response_holds_only_the_requested_outputs():
    """python_backend r24.10 drops outputs a client did not ask for without the GIL (a race that
    frees numpy arrays under other threads): the llm builds only what was asked for."""
    from triton_vlm.contract.sampling import SamplingParams
    from triton_vlm.llm.engine.responses import ResponseBuilder
    from triton_vlm.llm.engine.streaming import GenerationOutput, TokenLogprobs

    params = SamplingParams.from_inputs({"max_tokens": np.array([4], np.int32),
                                         "return_log_probs": np.array([True]),
                                         "return_num_input_tokens": np.array([True])})
    every = ResponseBuilder(params, stream=True, num_input_tokens=7)
    only = ResponseBuilder(params, stream=True, num_input_tokens=7, requested=frozenset({"text_output", "finish_reason"}))
    for out in (GenerationOutput([5], "a", logprobs=[TokenLogprobs(-0.5, [], [])]),
                GenerationOutput([6], "b", "length", logprobs=[TokenLogprobs(-1.0, [], [])])):
        full, part = every.add(out), only.add(out)
        assert {"output_ids", "text_output", "cum_log_probs"} <= set(full)
        assert set(part) == {"text_output", "finish_reason"}
        for name in part:
            assert part[name].tolist() == full[name].tolist()
    assert "num_input_tokens" in full
    assert set(ResponseBuilder(params, stream=True, num_input_tokens=7, requested=frozenset()).add(out)) == set(full)


@pytest.mark.parametrize("model", ["ensemble", "llm"])
def test_clients_asking_for_text_output_alone_get_it(server, model):
    """Streamed requests that ask for one output, several at once, get that output alone and the
    same text as a request asking for all (the model sends nothing for the stub to drop)."""
    from tritonclient.utils import np_to_triton_dtype

    from triton_vlm.clients.client import generate

    text = {"text_input": tensor(PROMPT, "BYTES")}
    if model == "llm":
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            pre = client.infer("preprocess", grpc_inputs(text))
        arrays = {name: pre.as_numpy(name) for name in ("input_ids", "mrope_position_ids", "mrope_position_delta")}
        values = {name: (array, np_to_triton_dtype(array.dtype)) for name, array in arrays.items()}
    else:
        values = text
    values = {**values, "max_tokens": tensor(N, "INT32"), "stream": tensor(True, "BOOL")}
    expected = generate(server.grpc_url, PROMPT, [], [], max_tokens=N, stream=True).text
    replies: queue.SimpleQueue = queue.SimpleQueue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: replies.put((result, error)))
        for i in range(4):
            client.async_stream_infer(model, grpc_inputs(values), request_id=f"subset-{i}",
                                      outputs=[grpcclient.InferRequestedOutput("text_output")],
                                      enable_empty_final_response=True)
        texts: dict[str, str] = {f"subset-{i}": "" for i in range(4)}
        done = 0
        while done < 4:
            result, error = replies.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            assert {o.name for o in response.outputs} <= {"text_output"}
            if result.as_numpy("text_output") is not None:
                texts[response.id] += b"".join(result.as_numpy("text_output").reshape(-1)).decode()
            done += response.parameters["triton_final_response"].bool_param
        client.stop_stream()
    assert set(texts.values()) == {expected}


def test_num_return_sequences_over_http(server):
    """generate_stream: each sequence's events, tagged with its index. Not streamed, each sequence
    ends with a response of its own, which Triton's generate (one answer per request) refuses,
    pointing at generate_stream."""
    sampled = dict(temperature=1.0, top_k=40, seed=7, num_return_sequences=2)
    events = http_generate(server.http_url, generate_payload(PROMPT, max_tokens=4, **sampled), stream=True)
    assert sorted({e["sequence_index"] for e in events}) == [0, 1]
    assert sum(bool(e["finish_reason"]) for e in events) == 2
    (answer,) = http_generate(server.http_url, generate_payload(PROMPT, max_tokens=4, **sampled))
    assert "use generate stream" in answer["error"]
