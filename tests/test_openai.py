"""Issue #16: `triton-vlm openai` (FastAPI on uvicorn, a real process on a free loopback port) in
front of the session's tritonserver, driven by the official `openai` client.

Each answer is compared with the `ensemble` called directly (gRPC streaming or HTTP generate) on
the prompt that transformers' processor renders from the same messages (text completions: the
prompt as it is), log-probabilities and penalties included; errors come back in OpenAI's format,
a refused field named in `param`; a client that goes away mid-stream leaves no KV block used.
tests/test_openai_fields.py checks, in process, what every request field does.
"""
from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from tests.metrics import wait_for
from triton_vlm.clients.chat import load_chat_template, render_chat
from triton_vlm.clients.client import generate, grpc_inputs, request_values
from triton_vlm.errors import InvalidInput
from triton_vlm.families import FAMILIES
from triton_vlm.families.glm4v.demo import GLM_TEMPLATE
from triton_vlm.families.llava.demo import LLAVA_TEMPLATE
from triton_vlm.families.minicpmv.demo import MINICPMV_TEMPLATE
from triton_vlm.families.qwen2_5_vl.demo import QWEN_TEMPLATE
from triton_vlm.media import samples

MODEL = "tiny-qwen"
IMAGE = samples.image_bytes(96, 64)
VIDEO = samples.video_bytes(seconds=1.0, fps=8, width=64, height=48)


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def api(server, tiny_checkpoint, tmp_path_factory):
    """`triton-vlm openai` against the session server, on a free port; always stopped."""
    from tests.servers import openai_api

    with openai_api(server.grpc_url, tiny_checkpoint, tmp_path_factory.mktemp("openai") / "openai.log", MODEL) as api:
        yield api


@pytest.fixture(scope="module")
def processor(tiny_checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_checkpoint)


def _direct(server, processor, content: list[dict], images=(), videos=(), max_tokens: int = 12):
    """The ensemble's greedy answer to the prompt transformers renders (media parts as
    `{"type": "image"}` / `{"type": "video"}`), and that prompt's expanded length (`preprocess`)."""
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    values = {k: v for k, v in request_values(prompt, images, videos).items()
              if k in ("text_input", "images", "videos")}
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        prompt_tokens = len(client.infer("preprocess", grpc_inputs(values)).as_numpy("input_ids"))
    return generate(server.grpc_url, prompt, images, videos, max_tokens=max_tokens, stream=False), prompt_tokens


def test_models_lists_the_served_model(api):
    assert [m.id for m in api.models.list().data] == [MODEL]


def test_image_chat_equals_the_ensemble_streamed_and_not(api, server, processor):
    direct, prompt_tokens = _direct(server, processor, [{"type": "image"}, {"type": "text", "text": "What is this?"}],
                                    [IMAGE])
    image = {"type": "image_url", "image_url": {"url": _data_url(IMAGE, "image/jpeg")}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    answer = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert answer.object == "chat.completion" and answer.model == MODEL
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == direct.text
    assert answer.choices[0].finish_reason == direct.finish_reason == "length"
    assert answer.usage.completion_tokens == len(direct.output_ids) == 12
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.usage.total_tokens == prompt_tokens + 12

    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == prompt_tokens


def test_video_and_a_system_turn_equal_the_ensemble(api, server, processor):
    direct, _ = _direct(server, processor, [{"type": "video"}, {"type": "text", "text": "What moves?"}], (), [VIDEO])
    answer = api.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": _data_url(VIDEO, "video/mp4")}},
                                     {"type": "text", "text": "What moves?"}]}])
    assert answer.choices[0].message.content == direct.text
    assert answer.usage.completion_tokens == len(direct.output_ids)

    # Several turns and string content: the prompt is the processor's for the same messages.
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    prompt = processor.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    direct = generate(server.grpc_url, prompt, max_tokens=8, stream=False)
    answer = api.chat.completions.create(model=MODEL, messages=turns, max_completion_tokens=8, temperature=0)
    assert answer.choices[0].message.content == direct.text


def test_stop_seed_and_sampling_reach_the_ensemble(api, server, processor):
    direct, _ = _direct(server, processor, [{"type": "text", "text": "Count"}], max_tokens=16)
    stop = direct.text[len(direct.text) // 2:][:2]
    sampled = [api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count"}],
                                           max_tokens=16, temperature=0.9, top_p=0.9, seed=7, stop=[stop])
               for _ in range(2)]
    assert sampled[0].choices[0].message.content == sampled[1].choices[0].message.content
    greedy = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=16,
                                         temperature=0, stop=stop)
    assert greedy.choices[0].finish_reason == "stop"
    assert greedy.choices[0].message.content == direct.text[:direct.text.index(stop)]


def _chat_prompt(processor, text: str) -> str:
    return processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]}],
                                         add_generation_prompt=True, tokenize=False)


def test_logprobs_are_the_ensembles_output_log_probs(api, server, processor, tiny_checkpoint):
    """`logprobs=True`: each chosen token's log-probability as the ensemble computes it (its
    `output_log_probs`, checked against transformers by the golden tests), its text the token
    decoded alone; no alternatives. Streamed, the same values arrive across the chunks."""
    from triton_vlm.clients.client import generate_payload, http_generate
    from triton_vlm.tokenizer import load_tokenizer

    (direct,) = http_generate(server.http_url, generate_payload(_chat_prompt(processor, "Count"), max_tokens=8,
                                                                return_log_probs=True))
    messages = [{"role": "user", "content": "Count"}]
    answer = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True)
    content = answer.choices[0].logprobs.content
    tokenizer = load_tokenizer(tiny_checkpoint)
    assert [c.token for c in content] == [tokenizer.decode([i], skip_special_tokens=False)
                                          for i in direct["output_ids"]]
    assert [c.logprob for c in content] == pytest.approx(direct["output_log_probs"], abs=1e-6)
    assert all(c.top_logprobs == [] and c.bytes == list(c.token.encode()) for c in content)
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              logprobs=True, stream=True))
    streamed = [c.logprob for chunk in chunks for choice in chunk.choices if choice.logprobs
                for c in choice.logprobs.content]
    assert streamed == pytest.approx(direct["output_log_probs"], abs=1e-6)
    assert api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).choices[0].logprobs is None


def test_top_logprobs_and_n_choices_are_the_ensembles(api, server, processor, tiny_checkpoint):
    """`top_logprobs`: each token's alternatives are the ensemble's `top_log_probs` (checked against
    transformers there), the first the greedy token. `n`: choice i of a request seeded s is what
    the ensemble draws with seed s + i, streamed or not."""
    from triton_vlm.clients.client import generate_payload, http_generate
    from triton_vlm.tokenizer import load_tokenizer

    text = load_tokenizer(tiny_checkpoint).decode
    prompt, messages = _chat_prompt(processor, "Count"), [{"role": "user", "content": "Count"}]
    (direct,) = http_generate(server.http_url, generate_payload(prompt, max_tokens=6, num_top_log_probs=3))
    answer = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    ids = np.array(direct["top_log_prob_ids"]).reshape(6, 3)
    assert [[a.token for a in c.top_logprobs] for c in content] == \
        [[text([i], skip_special_tokens=False) for i in row] for row in ids.tolist()]
    assert np.allclose([[a.logprob for a in c.top_logprobs] for c in content],
                       np.array(direct["top_log_probs"]).reshape(6, 3), atol=1e-6)
    assert [c.token for c in content] == [c.top_logprobs[0].token for c in content]

    sampled = dict(max_tokens=8, temperature=1.0, top_k=40)
    draws = [http_generate(server.http_url, generate_payload(prompt, seed=50 + i, **sampled))[0] for i in range(3)]
    seeded = [d["text_output"] for d in draws]
    assert len(set(seeded)) > 1
    answer = api.chat.completions.create(model=MODEL, messages=messages, n=3, seed=50, extra_body={"top_k": 40},
                                         max_tokens=8, temperature=1.0)
    assert [(c.index, c.message.content) for c in answer.choices] == list(enumerate(seeded))
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, n=3, seed=50, extra_body={"top_k": 40},
                                              max_tokens=8, temperature=1.0, stream=True))
    streamed = ["".join(c.delta.content or "" for chunk in chunks for c in chunk.choices if c.index == i)
                for i in range(3)]
    assert streamed == seeded
    assert answer.usage.completion_tokens == sum(len(d["output_ids"]) for d in draws)


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                                     {"presence_penalty": -1.0, "frequency_penalty": 1.5}])
def test_presence_and_frequency_penalties_are_the_ensembles(api, server, processor, penalty):
    """The penalties reach the ensemble, which applies them (OpenAI's / vLLM's definition, over the
    generated ids): the greedy answer is the ensemble's with the same penalties, not the plain one."""
    from triton_vlm.clients.client import generate_payload, http_generate

    prompt = _chat_prompt(processor, "Repeat after me: la la la la")
    (plain,) = http_generate(server.http_url, generate_payload(prompt, max_tokens=24))
    (direct,) = http_generate(server.http_url, generate_payload(prompt, max_tokens=24, **penalty))
    assert direct["output_ids"] != plain["output_ids"]
    answer = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Repeat after me: la la "
                                                                                           "la la"}],
                                         max_tokens=24, temperature=0, **penalty)
    assert answer.choices[0].message.content == direct["text_output"]


def test_stream_options_include_usage(api):
    messages = [{"role": "user", "content": "hi"}]
    plain = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True))
    assert all(c.usage is None and c.choices for c in plain)
    counted = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True,
                                               stream_options={"include_usage": True}))
    assert all(c.usage is None for c in counted[:-1])
    assert counted[-1].choices == [] and counted[-1].usage.completion_tokens == 4
    assert counted[-1].usage.total_tokens == counted[-1].usage.prompt_tokens + 4


def test_text_completions_send_the_raw_prompt_streamed_and_not(api, server):
    """`/v1/completions`: the prompt goes to the ensemble as it is (no chat template); the answer,
    streamed or not, is the ensemble's, with the same log-probabilities (`logprobs=0`)."""
    from triton_vlm.clients.client import generate_payload, http_generate

    prompt = "Once upon a time"
    (direct,) = http_generate(server.http_url, generate_payload(prompt, max_tokens=10, return_log_probs=True))
    answer = api.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=0)
    assert answer.object == "text_completion" and answer.model == MODEL
    (choice,) = answer.choices
    assert choice.text == direct["text_output"] and choice.finish_reason == direct["finish_reason"]
    assert choice.logprobs.token_logprobs == pytest.approx(direct["output_log_probs"], abs=1e-6)
    assert answer.usage.completion_tokens == len(direct["output_ids"])
    assert answer.usage.prompt_tokens == direct["num_input_tokens"]

    chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == direct["text_output"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == direct["finish_reason"]
    assert chunks[-1].usage.completion_tokens == len(direct["output_ids"])

    seeded = [api.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.9, seed=3,
                                     presence_penalty=0.5, stop=["zzz"]).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    for kwargs, param in (({"prompt": ["a", "b"]}, "prompt"), ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"),
                          ({"best_of": 2}, "best_of"), ({"logprobs": 21}, "logprobs")):
        status, error = _error(lambda: api.completions.create(model=MODEL, **{"prompt": prompt, **kwargs},
                                                              max_tokens=2))
        assert status == 400 and error["param"] == param, (kwargs, error)


def test_response_format_guides_the_answer(api):
    import jsonschema

    schema = {"type": "object", "required": ["city", "size"],
              "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "size": {"enum": ["big", "small"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    answer = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A city"}], max_tokens=40,
                                         temperature=0, response_format=fmt)
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    status, error = _error(lambda: api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city"}], max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object",
                                                                                            "properties": 5}}}))
    assert status == 400 and error["message"].startswith("guided_decoding_guide: invalid JSON schema")


def _idle(values: dict) -> bool:
    return (values.get("triton_vlm_llm_requests:running") == 0 and values.get("triton_vlm_llm_requests:waiting") == 0
            and values.get("triton_vlm_llm_kv_blocks:used") == 0)


def test_a_client_gone_mid_stream_frees_the_llms_blocks(api, server):
    before = wait_for(server, _idle)["triton_vlm_llm_generated_tokens"]
    stream = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A long story"}],
                                         max_tokens=3000, temperature=0, stream=True)
    received = 0
    for chunk in stream:
        received += 1
        if received == 5:
            break
    busy = wait_for(server, lambda v: v.get("triton_vlm_llm_kv_blocks:used", 0) > 0, timeout=10)
    assert busy["triton_vlm_llm_kv_blocks:used"] > 0
    stream.close()  # the HTTP connection goes, no goodbye
    after = wait_for(server, _idle, timeout=10)
    assert _idle(after), after
    assert after["triton_vlm_llm_generated_tokens"] - before < 300


def _error(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as raised:
        call()
    body = raised.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return raised.value.status_code, body["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_errors_are_openais(api, stream):
    def chat(content, **kwargs):
        return lambda: api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                   max_tokens=4, stream=stream, **kwargs)

    url = "http://example.com/cat.jpg"
    status, error = _error(chat([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]))
    assert status == 400 and url in error["message"] and error["type"] == "invalid_request_error"
    status, error = _error(chat([{"type": "video_url", "video_url": {"url": "/etc/passwd"}}]))
    assert status == 400 and "'/etc/passwd' is not a data: URL" in error["message"]
    status, error = _error(chat("hi", n=17))  # the most sequences one request may ask for: 16
    assert status == 400 and error["param"] == "n"
    status, error = _error(chat("hi", temperature=-1))  # the ensemble's own refusal
    assert (status, error["message"]) == (400, "temperature: must be >= 0, got -1")
    status, error = _error(chat([{"type": "image_url", "image_url": {"url": _data_url(b"no image", "image/png")}}]))
    assert status == 400 and error["message"].startswith("images[0]")
    placeholder = FAMILIES["qwen2_5_vl"].image_placeholder
    status, error = _error(chat(f"{placeholder} spelled out"))
    assert status == 400 and error["param"] == "messages"
    status, error = _error(chat("hi", frequency_penalty=2.5))  # the ensemble checks the range
    assert (status, error["message"]) == (400, "frequency_penalty: must be in [-2, 2], got 2.5")
    status, error = _error(chat("hi", top_logprobs=2))  # alternatives without logprobs: refused by name
    assert status == 400 and error["param"] == "top_logprobs"
    status, error = _error(chat("hi", response_format={"type": "json_schema"}))
    assert status == 400 and error["param"] == "response_format"
    status, error = _error(chat("hi", extra_body={"temprature": 0.5}))
    assert status == 400 and error["param"] == "temprature"
    status, error = _error(lambda: api.chat.completions.create(model="gpt-4o", messages=[{"role": "user",
                                                                                          "content": "hi"}]))
    assert status == 404 and error["code"] == "model_not_found"


def test_media_parts_beyond_the_ensembles_limit_are_refused(api):
    """The served preprocess takes max_media_items=16 (the default): a 17th part is refused by the
    front, naming the part and the limit."""
    image = {"type": "image_url", "image_url": {"url": _data_url(IMAGE, "image/png")}}
    status, error = _error(lambda: api.chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [image] * 17 + [{"type": "text", "text": "?"}]}]))
    assert status == 400 and error["param"] == "messages[0].content[16]" and "max_media_items=16" in error["message"]


def test_a_body_beyond_the_media_limits_is_413_before_it_is_read(api):
    """The session repository takes 2 MiB of media per request: 4/3 of it as base64 and 1 MiB of
    text is the largest body read, whether its length is announced or it comes in chunks."""
    import http.client
    import json

    from triton_vlm.clients.body_limit import TEXT_BYTES

    limit = -(-(2 << 20) // 3) * 4 + TEXT_BYTES
    host, port = api.base_url.host, api.base_url.port
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * limit}]}).encode()
    for chunked in (False, True):
        connection = http.client.HTTPConnection(host, port, timeout=60)
        try:
            if chunked:
                pieces = (body[i:i + (64 << 10)] for i in range(0, len(body), 64 << 10))
                connection.request("POST", "/v1/chat/completions", body=pieces, encode_chunked=True,
                                   headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
            else:
                connection.request("POST", "/v1/chat/completions", body=body,
                                   headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            error = json.loads(response.read())["error"]
        finally:
            connection.close()
        assert response.status == 413 and str(limit) in error["message"], chunked
    # announced too large: refused before a byte of the body is sent
    import socket

    with socket.create_connection((host, port), timeout=60) as raw:
        raw.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {limit + 1}\r\n\r\n".encode())
        assert raw.recv(64).startswith(b"HTTP/1.1 413 ")
    # a body just under the limit is read and answered (`user`: accepted, unused)
    answer = api.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                         user="x" * (limit - (64 << 10)))
    assert answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize("template,families", [(QWEN_TEMPLATE, ["qwen2_5_vl", "qwen2_vl"]), (MINICPMV_TEMPLATE, ["minicpmv4_6"]),
                                               (LLAVA_TEMPLATE, ["llava"]),
                                               (GLM_TEMPLATE, ["glm4v", "glm46v", "glmga", "glm_ocr", "glm4v_moe"])])
def test_render_chat_places_each_familys_placeholders_in_order(template, families):
    for family in map(FAMILIES.get, families):
        content = [{"type": "video"}, {"type": "text", "text": "then"}, {"type": "image"}, {"type": "image"}]
        prompt = render_chat(template, family, [{"role": "system", "content": "sys"},
                                                {"role": "user", "content": content}])
        img, vid = family.image_placeholder, family.video_placeholder
        assert prompt.count(img) == 2 and prompt.count(vid) == 1
        assert prompt.index(vid) < prompt.index("then") < prompt.index(img)
        with pytest.raises(InvalidInput, match="placeholders for \\[image, image\\] where the messages have media "
                                               "\\[image\\]"):
            render_chat(template, family, [{"role": "user", "content": [{"type": "image"},
                                                                        {"type": "text", "text": img}]}])


def test_render_chat_is_the_processors_apply_chat_template(tiny_checkpoint, processor):
    messages = [{"role": "system", "content": "sys"},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "video"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "b"}]}, {"role": "user", "content": "c"}]
    assert render_chat(load_chat_template(tiny_checkpoint), FAMILIES["qwen2_5_vl"], messages) \
        == processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("family, case", [(f, c) for f in ("minicpmv2_6", "minicpmv4_0") for c in ("c_two_images",
                                                                                                  "d_text_only")]
                         + [("minicpmv4_5", c) for c in ("a_image_640x480", "c_two_images", "d_video", "e_text_only")]
                         + [("minicpmv2_5", c) for c in ("a_image_480x640", "c_two_images", "d_text_only")])
def test_render_chat_is_the_official_minicpmv_chat(family, case):
    """The official remote-code templates take string content only: the parts joined by newlines,
    media as their placeholders, rendered as the official `chat()` writes the golden prompts (4.5
    with `enable_thinking=False`, a video as one marker, which `preprocess` expands to its frames'
    lines; 2.6's template adds its default system prompt)."""
    from tests.minicpmv_golden import SETS

    c = SETS[family].cases[case]
    parts = [{"type": "text", "text": part} if isinstance(part, str) else {"type": "video" if "video_frames" in part
             else "image"} for part in c["chat"]["msgs"][0]["content"]]
    prompt = render_chat(load_chat_template(SETS[family].root), FAMILIES[family], [{"role": "user", "content": parts}])
    frames = "\n".join(["(<image>./</image>)"] * len(c.get("video", {}).get("frame_indices", [])))
    assert prompt == (c["prompt"].replace(frames, "(<video>./</video>)") if frames else c["prompt"])


def test_load_chat_template_reads_json_and_tokenizer_config(tmp_path):
    import json

    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert load_chat_template(tmp_path) == "J"
    (tmp_path / "chat_template.jinja").write_text("K")
    assert load_chat_template(tmp_path) == "K"


def test_genai_perf_openai_vision_mode(api, tiny_checkpoint, tmp_path):
    """genai-perf's OpenAI multimodal mode (chat with synthetic images as data URLs) against this
    endpoint: every request answered, tokens streamed."""
    from tests.test_genai_perf import REQUESTS, check
    from triton_vlm.tools.loadtest import genai_perf

    url = str(api.base_url).removeprefix("http://").removesuffix("/v1/").removesuffix("/v1")
    check(genai_perf(url, "multimodal", tiny_checkpoint, model=MODEL, requests=REQUESTS, output_tokens=8,
                     image_size=64, workdir=tmp_path))
    (sent,) = tmp_path.glob("multimodal/*/inputs.json")
    assert sent.read_text().count("data:image/png;base64,") >= REQUESTS  # an image in every request


def test_ensemble_errors_map_to_openai_statuses():
    """A step that died (`restarted`) and a server gone (gRPC UNAVAILABLE, while `triton-vlm serve`
    restarts it) are 503s a client may retry; overload is 503 too, a bad request 400."""
    import grpc

    from triton_vlm.clients.client import RequestError
    from triton_vlm.clients.openai_responses import ensemble_error
    from triton_vlm.errors import busy
    from triton_vlm.serving.pipeline import restarted

    def answer(error) -> tuple[int, str]:
        body = ensemble_error(error).body()["error"]
        return ensemble_error(error).status, body.get("code") or ""

    empty = grpc.aio.Metadata()
    assert answer(RequestError(restarted("llm").message)) == (503, "step_restarted")
    assert answer(RequestError(busy("4 requests in flight"))) == (503, "server_busy")
    assert answer(RequestError("images[0]: not a decodable image")) == (400, "")
    assert answer(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, empty, empty, "Socket closed"))[0] == 503
    assert answer(grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, empty, empty, "boom"))[0] == 500


def test_logit_bias_reaches_the_llm(api, tiny_checkpoint):
    """`logit_bias` (OpenAI's, a token id's bias) travels as the ensemble's `embedding_bias`: a
    +100 makes every greedy token that id."""
    from triton_vlm.tokenizer import load_tokenizer

    answer = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         temperature=0, logit_bias={"42": 100}, logprobs=True)
    token = load_tokenizer(tiny_checkpoint).decode([42], skip_special_tokens=False)
    assert [t.token for t in answer.choices[0].logprobs.content] == [token] * 5
    status, error = _error(lambda: api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                               max_tokens=4, logit_bias={"42": 101}))
    assert status == 400 and error["param"] == "logit_bias"
