"""The `llm` engine against transformers' Qwen2.5-VL as the oracle (tiny random checkpoint, CPU).

Inputs come from the HF processor; vision rows from `model.model.visual(...).pooler_output`;
positions from `model.model.get_rope_index` (transformers' rule for text after a video: the engine
takes positions as given, so whichever rule produced them, it must reproduce HF generate).
"""
from __future__ import annotations

import json
import os
import shutil
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from triton_vlm.errors import InvalidInput
from triton_vlm.llm import Engine, GenerationOutput, IncrementalDetokenizer, SamplingParams, prompt_logits

PROMPTS = {
    "text": ("describe the red car on the road", [], []),
    "image": ("<|vision_start|><|image_pad|><|vision_end|>what is in this image", ["img0"], []),
    "video": ("<|vision_start|><|video_pad|><|vision_end|>what is moving in the video", [], ["vid0"]),
    "image+video": ("<|vision_start|><|image_pad|><|vision_end|>two<|vision_start|><|video_pad|>"
                    "<|vision_end|>tell me about the left one", ["img1"], ["vid1"]),
}
TIMEOUT = 60


@pytest.fixture(scope="session")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="session")
def hf(hf):
    """(model, processor) of the shared oracle."""
    return hf.model, hf.processor


@pytest.fixture(scope="session")
def media():
    from PIL import Image

    rng = np.random.default_rng(1)
    return {
        "img0": Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)),
        "img1": Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)),
        "vid0": rng.integers(0, 256, (20, 56, 56, 3), dtype=np.uint8),   # 2 s at 10 fps
        "vid1": rng.integers(0, 256, (40, 56, 84, 3), dtype=np.uint8),   # 4 s at 10 fps
    }


@pytest.fixture(scope="session")
def requests(hf, media):
    """Per prompt: HF processor inputs and the `llm` inputs made from them."""
    from transformers.video_utils import VideoMetadata

    model, proc = hf
    out = {}
    for name, (text, images, videos) in PROMPTS.items():
        prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        kwargs = {}
        if images:
            kwargs["images"] = [media[k] for k in images]
        if videos:
            frames = [media[k] for k in videos]
            kwargs.update(videos=frames, do_sample_frames=True, fps=2,
                          video_metadata=[VideoMetadata(total_num_frames=len(f), fps=10, width=f.shape[2],
                                                        height=f.shape[1]) for f in frames])
        inputs = proc(text=[prompt], return_tensors="pt", **kwargs)
        with torch.no_grad():
            rows = []  # prompt order: each prompt above has its image before its video
            if "pixel_values" in inputs:
                rows.append(model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output)
            if "pixel_values_videos" in inputs:
                rows.append(model.model.visual(inputs["pixel_values_videos"],
                                               grid_thw=inputs["video_grid_thw"]).pooler_output)
            pos, delta = model.model.get_rope_index(
                inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                image_grid_thw=inputs.get("image_grid_thw"), video_grid_thw=inputs.get("video_grid_thw"),
                second_per_grid_ts=inputs.get("second_per_grid_ts"))
        out[name] = llm_request(model, inputs, rows, pos, delta)
    return out


@pytest.fixture(scope="session")
def engine(ckpt):
    eng = Engine(ckpt)
    yield eng
    eng.shutdown()


class Collector:
    def __init__(self, on_emit=None):
        self.outputs: list[GenerationOutput] = []
        self.done = threading.Event()
        self.on_emit = on_emit

    def __call__(self, out: GenerationOutput) -> None:
        assert not self.done.is_set(), "emit after the final output"
        self.outputs.append(out)
        if self.on_emit:
            self.on_emit(self)
        if out.finish_reason is not None:
            self.done.set()

    def wait(self) -> "Collector":
        assert self.done.wait(TIMEOUT), "no final emit"
        return self

    @property
    def ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def finish_reason(self):
        return self.outputs[-1].finish_reason


def submit(engine, req, params, request_id, **kw) -> Collector:
    col = Collector(kw.pop("on_emit", None))
    engine.submit(request_id, **req["llm"], params=params, emit=col, **kw)
    return col


def hf_generate(hf, req, **kw) -> list[int]:
    model, _ = hf
    inputs = req["hf_inputs"]
    with torch.no_grad():
        out = model.generate(**inputs, **kw)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_greedy_with_logits(hf_model, req, max_new_tokens: int) -> tuple[list[int], tuple[torch.Tensor, ...]]:
    """HF greedy `generate`: the new token ids and every step's logits [1, vocab]."""
    inputs = req["hf_inputs"]
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), out.logits


def greedy_in_steps(engine, checkpoint, req, request_id: str, max_tokens: int, budget: int) -> tuple[Collector, int]:
    """A greedy request through `engine`, or, with a `budget` other than its step size, through an
    engine on the same model whose steps hold at most `budget` tokens (the prompt prefilled in
    chunks), shut down after: the finished request and the steps it took."""
    eng = engine if budget == engine.settings.max_num_tokens else Engine(
        checkpoint, model=engine.model, max_num_tokens=budget, return_logits=True)
    try:
        steps = eng.num_steps
        col = submit(eng, req, SamplingParams(max_tokens=max_tokens), request_id).wait()
        assert eng.kv_blocks_used == 0
        return col, eng.num_steps - steps
    finally:
        if eng is not engine:
            eng.shutdown()


def assert_matches_generate(col, eos_token_ids, expected: list[int], logits) -> None:
    """The request's tokens and finish reason are HF's, every step's logits within 1e-4 of HF's
    (needs an engine with return_logits)."""
    assert col.ids == expected
    assert col.finish_reason == ("stop" if expected[-1] in eos_token_ids else "length")
    for ours, ref in zip(col.outputs, logits):
        assert torch.allclose(ours.logits, ref[0], atol=1e-4, rtol=0), (ours.logits - ref[0]).abs().max()


# ---- equality with transformers -------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PROMPTS))
def test_prefill_logits_match_hf(hf, engine, requests, name):
    model, _ = hf
    assert_prefill_logits_match(model, engine, requests[name])


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_hf_generate(hf, engine, requests, name):
    req = requests[name]
    expected = hf_generate(hf, req, max_new_tokens=16, do_sample=False)
    col = submit(engine, req, SamplingParams(max_tokens=16), f"greedy-{name}").wait()
    assert col.ids == expected
    assert all(o.finish_reason is None for o in col.outputs[:-1])
    assert col.finish_reason == ("stop" if expected[-1] in engine.eos_token_ids else "length")
    assert [len(o.token_ids) for o in col.outputs] == [1] * len(col.ids)
    # streamed text pieces add up to the decoded ids; no piece but the last ends in a partial character
    assert col.text == engine.tokenizer.decode(col.ids, skip_special_tokens=True)
    assert not any(o.text.endswith("\ufffd") for o in col.outputs[:-1])


def test_seeded_sampling_matches_hf(hf, engine, requests):
    """Same seed for the global RNG (HF) and the request's generator: same multinomial draws."""
    req = requests["image"]
    torch.manual_seed(1234)
    expected = hf_generate(hf, req, max_new_tokens=12, do_sample=True, temperature=0.7, top_k=40, top_p=0.9)
    params = SamplingParams(max_tokens=12, temperature=0.7, top_k=40, top_p=0.9, seed=1234)
    assert submit(engine, req, params, "seeded-hf").wait().ids == expected


def test_eos_gives_stop(hf, ckpt, requests, tmp_path, engine):
    """An eos id read from generation_config.json ends with "stop", the eos token included, as HF."""
    req = requests["text"]
    greedy = submit(engine, req, SamplingParams(max_tokens=16), "eos-probe").wait().ids
    eos = greedy[3]
    for f in os.listdir(ckpt):
        (shutil.copy if f.endswith(".json") else os.symlink)(os.path.join(ckpt, f), tmp_path / f)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen["eos_token_id"] = [eos]
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    eng = Engine(tmp_path)
    try:
        col = submit(eng, req, SamplingParams(max_tokens=16), "eos").wait()
    finally:
        eng.shutdown()
    assert col.finish_reason == "stop"
    assert col.ids == greedy[:greedy.index(eos) + 1]
    assert col.ids == hf_generate(hf, req, max_new_tokens=16, do_sample=False, eos_token_id=[eos])


def test_max_tokens_gives_length(engine, requests):
    col = submit(engine, requests["video"], SamplingParams(max_tokens=3), "len3").wait()
    ids16 = submit(engine, requests["video"], SamplingParams(max_tokens=16), "len16").wait().ids
    if not set(ids16[:3]) & engine.eos_token_ids:
        assert col.finish_reason == "length" and col.ids == ids16[:3]


def test_stop_words(engine, requests):
    req = requests["image+video"]
    full = submit(engine, req, SamplingParams(max_tokens=16), "full").wait()
    text = full.text.replace("\ufffd", "")
    assert len(text) >= 4, text
    word = text[len(text) // 2: len(text) // 2 + 2]
    col = submit(engine, req, SamplingParams(max_tokens=16, stop_words=["\x00never", word]), "sw").wait()
    assert col.finish_reason == "stop"
    assert col.text == full.text[:full.text.index(word)]
    assert col.ids == full.ids[:len(col.ids)] and len(col.ids) < 16


# ---- concurrency, seeds, cancellation ---------------------------------------------------------------

def test_concurrent_requests_match_alone(engine, requests):
    jobs = []
    for i, name in enumerate(PROMPTS):
        jobs.append((name, SamplingParams(max_tokens=12)))
        jobs.append((name, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=100 + i)))
    alone = [submit(engine, requests[n], p, f"alone-{i}").wait().ids for i, (n, p) in enumerate(jobs)]
    seen_running = []
    cols = [submit(engine, requests[n], p, f"conc-{i}", on_emit=lambda c: seen_running.append(engine.num_running))
            for i, (n, p) in enumerate(jobs)]
    together = [c.wait().ids for c in cols]
    assert together == alone
    assert max(seen_running) > 1  # they really did run at the same time
    again = [submit(engine, requests[n], p, f"again-{i}").wait().ids for i, (n, p) in enumerate(jobs)]
    assert again == alone  # seeded sampling repeats


def test_cancel_frees_cache(engine, requests):
    stop_after = 3
    col = Collector()
    engine.submit("cancel-me", **requests["image"]["llm"], params=SamplingParams(max_tokens=64), emit=col,
                  is_cancelled=lambda: len(col.outputs) >= stop_after)
    col.wait()
    assert col.finish_reason == "cancelled"
    assert len(col.ids) == stop_after and col.outputs[-1].token_ids == []
    assert engine.kv_blocks_used == 0 and engine.num_running == 0
    # Engine.cancel() on a request that has not started yet
    gate = threading.Event()
    slow = submit(engine, requests["text"], SamplingParams(max_tokens=8), "slow",
                  on_emit=lambda c: gate.wait(TIMEOUT))
    waiting = submit(engine, requests["text"], SamplingParams(max_tokens=8), "waiting")
    engine.cancel("waiting")
    gate.set()
    assert waiting.wait().finish_reason == "cancelled" and waiting.ids == []
    assert slow.wait().finish_reason == "length"
    assert engine.kv_blocks_used == 0


def test_stops_for_ids_not_in_flight_are_bounded(engine, requests):
    """A stop that overtakes its request still ends it; stops for ids that never come (anyone may
    send them to the llm) are kept up to a bound, not forever."""
    from triton_vlm.llm.engine import engine as engine_module

    engine.cancel("early")
    col = submit(engine, requests["text"], SamplingParams(max_tokens=8), "early").wait()
    assert col.finish_reason == "cancelled" and col.ids == []
    for i in range(3 * engine_module._EARLY_STOPS):
        engine.cancel(f"never-{i}")
    assert len(engine._early_stops) == engine_module._EARLY_STOPS and not engine._cancel_ids
    engine.cancel("dropped")
    for i in range(engine_module._EARLY_STOPS):
        engine.cancel(f"later-{i}")
    # the oldest stops went: a request of that id runs
    assert submit(engine, requests["text"], SamplingParams(max_tokens=4), "dropped").wait().finish_reason == "length"
    assert submit(engine, requests["text"], SamplingParams(max_tokens=4), "early").wait().finish_reason == "length"


def test_error_inside_loop_ends_request_and_engine_survives(ckpt, requests):
    eng = Engine(ckpt)
    real = eng.model.forward
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(*a, **k)

    eng.model.forward = flaky
    try:
        col = submit(eng, requests["text"], SamplingParams(max_tokens=8), "err").wait()
        assert col.finish_reason == "error" and col.outputs[-1].error
        assert "boom" not in col.outputs[-1].error  # no internals leak to the client
        ok = submit(eng, requests["text"], SamplingParams(max_tokens=4), "after").wait()
        assert ok.finish_reason in ("length", "stop") and eng.kv_blocks_used == 0
        # an emit callback that raises does not kill the thread either
        def bad_emit(out):
            raise ValueError("client gone")
        eng.submit("bad", **requests["text"]["llm"], params=SamplingParams(max_tokens=4), emit=bad_emit)
        assert submit(eng, requests["text"], SamplingParams(max_tokens=2), "after2").wait().ids
    finally:
        eng.shutdown()


def test_sampling_errors_end_only_the_rows_concerned(ckpt, engine, requests, monkeypatch):
    """A request whose logits turn NaN ends with "error"; the one sampled beside it in the same steps
    is unaffected. A failing batched draw ends the requests of that step only."""
    from triton_vlm.llm.engine import runner as runner_module

    req = requests["text"]
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    alone = submit(engine, req, seeded, "nan-alone").wait().ids
    eng = Engine(ckpt)
    real = eng.runner.forward

    def nan_for_first(chunks):  # the first request (arrival 1) gets NaN logits after its 4th token
        logits = real(chunks).clone()  # (an inference tensor is read-only here)
        for row, chunk in enumerate(c for c in chunks if c.samples):
            if chunk.seq.arrival == 1 and chunk.end > len(req["llm"]["input_ids"]) + 3:
                logits[row] = float("nan")
        return logits

    eng.runner.forward = nan_for_first
    try:
        bad = submit(eng, req, SamplingParams(max_tokens=8, temperature=0.8, seed=1), "nan")
        good = submit(eng, req, seeded, "beside-nan")
        assert bad.wait().finish_reason == "error" and bad.outputs[-1].error == "internal error: non-finite logits"
        assert len(bad.ids) == 4
        assert good.wait().ids == alone
    finally:
        eng.shutdown()

    calls = {"n": 0}
    real_sample = runner_module.sample_batch

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_sample(*args)

    monkeypatch.setattr(runner_module, "sample_batch", flaky)
    eng = Engine(ckpt, model=engine.model)
    try:
        col = submit(eng, req, SamplingParams(max_tokens=8), "sample-err").wait()
        assert col.finish_reason == "error" and col.outputs[-1].error == "internal error: RuntimeError"
        assert len(col.ids) == 1
        assert submit(eng, req, SamplingParams(max_tokens=2), "after-sample-err").wait().finish_reason == "length"
        assert eng.kv_blocks_used == 0
    finally:
        eng.shutdown()


def test_shutdown_ends_requests_in_flight(ckpt, requests):
    eng = Engine(ckpt)
    gate = threading.Event()
    col = submit(eng, requests["text"], SamplingParams(max_tokens=50), "s", on_emit=lambda c: gate.wait(TIMEOUT))
    queued = submit(eng, requests["text"], SamplingParams(max_tokens=5), "q")
    threading.Timer(0.2, gate.set).start()
    eng.shutdown()
    assert col.wait().finish_reason == "cancelled" and queued.wait().finish_reason == "cancelled"


class FakeClock:
    """The engine's clock, moved by the test; with `step`, every reading is that much later."""

    def __init__(self, step: float = 0.0) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_queue_timeout_rejects_a_request_that_never_got_a_place(ckpt, engine, requests):
    clock = FakeClock()
    eng = Engine(ckpt, model=engine.model, max_running=1, queue_timeout_ms=1000, clock=clock)
    try:
        running, gate = threading.Event(), threading.Event()

        def hold(col: Collector) -> None:  # the scheduler waits in the first request's first emit
            running.set()
            gate.wait(TIMEOUT)

        first = submit(eng, requests["text"], SamplingParams(max_tokens=8), "first", on_emit=hold)
        assert running.wait(TIMEOUT)
        second = submit(eng, requests["text"], SamplingParams(max_tokens=8), "second")
        clock.now += 1.001  # the batch is full (max_running=1): second waits 1001 ms
        gate.set()
        second.wait()
        assert second.finish_reason == "rejected" and second.ids == [] and len(second.outputs) == 1
        assert second.outputs[-1].error == ("server busy: waited 1001 ms for a place in the llm batch, "
                                            "llm_queue_timeout_ms=1000; retry later")
        # The first ran longer than the timeout, but had its place: it ends as alone.
        alone = submit(engine, requests["text"], SamplingParams(max_tokens=8), "first-alone").wait()
        assert first.wait().ids == alone.ids and first.finish_reason == alone.finish_reason
        assert eng.kv_blocks_used == 0 and eng.num_waiting == 0 and eng.num_running == 0
        # The id is free again: the rejected request left nothing behind.
        assert submit(eng, requests["text"], SamplingParams(max_tokens=2), "second").wait().finish_reason == "length"
    finally:
        eng.shutdown()


def test_queue_timeout_spares_preempted_requests(ckpt, engine, requests):
    """Every clock reading is an hour later, so a request is rejected unless it gets its place at
    the first step that sees it; the preempted one waits again, and is not rejected for it."""
    llm, max_tokens, bs = requests["text"]["llm"], 24, 8
    n = int(llm["input_ids"].size)
    blocks = -(-(n + max_tokens) // bs) + -(-n // bs)  # one request in full and a second prompt
    eng = Engine(ckpt, model=engine.model, kv_cache_tokens=blocks * bs, block_size=bs, queue_timeout_ms=1000,
                 clock=FakeClock(step=3600.0))
    try:
        cols = [submit(eng, requests["text"], SamplingParams(max_tokens=max_tokens), f"p{i}") for i in range(2)]
        together = [c.wait() for c in cols]
        assert eng.num_preempted > 0
        alone = submit(engine, requests["text"], SamplingParams(max_tokens=max_tokens), "p-alone").wait()
        assert [(c.ids, c.finish_reason) for c in together] == [(alone.ids, alone.finish_reason)] * 2
        assert eng.kv_blocks_used == 0
    finally:
        eng.shutdown()


# ---- in-flight batching, paged KV cache, prefix cache, preemption -----------------------------------

def _jobs():
    """8 requests of different prompt lengths and max_tokens, greedy and seeded."""
    jobs = []
    for i, name in enumerate(PROMPTS):
        jobs.append((name, SamplingParams(max_tokens=6 + 3 * i)))
        jobs.append((name, SamplingParams(max_tokens=14 - 2 * i, temperature=0.9, top_k=50, top_p=0.9, seed=7 + i,
                                          repetition_penalty=1.1)))
    return jobs


def _alone(eng, requests, jobs, tag):
    return [submit(eng, requests[n], p, f"{tag}-alone-{i}").wait() for i, (n, p) in enumerate(jobs)]


def _together(eng, requests, jobs, tag):
    cols = [submit(eng, requests[n], p, f"{tag}-{i}") for i, (n, p) in enumerate(jobs)]
    return [c.wait() for c in cols]


def llm_request(model, inputs, rows, positions=None, delta=None) -> dict:
    """The HF processor's inputs and our llm's: its vision rows (HF's own), and its positions
    ([1 or 3, 1, S] from `get_rope_index`; None: plain 0..S-1) and delta."""
    n = inputs["input_ids"].shape[1]
    emb = torch.cat(rows).numpy() if rows else np.zeros((0, model.config.text_config.hidden_size), np.float32)
    mrope = np.broadcast_to(np.arange(n), (3, n)).copy() if positions is None else positions[:, 0].numpy()
    return dict(hf_inputs=inputs,
                llm=dict(input_ids=inputs["input_ids"][0].numpy().astype(np.int32), embeddings=emb,
                         mrope_position_ids=mrope.astype(np.int64),
                         mrope_position_delta=np.zeros(1, np.int64) if delta is None else delta[0].numpy().astype(np.int64)))


def assert_prefill_logits_match(hf_model, engine, req) -> None:
    """Our last-position prompt logits equal the HF model's forward on the same inputs."""
    with torch.no_grad():
        ref = hf_model(**req["hf_inputs"]).logits[0, -1]
    llm = req["llm"]
    logits = prompt_logits(engine.model, torch.from_numpy(llm["input_ids"]), torch.from_numpy(llm["embeddings"]),
                                        torch.from_numpy(llm["mrope_position_ids"]))
    assert torch.allclose(logits, ref, atol=1e-4, rtol=0), (logits - ref).abs().max()


def assert_chunked_concurrent_equal_alone(engine, requests: dict) -> None:
    """Greedy and seeded requests of every prompt of `requests` at once, in a small per-step token
    budget (prompts prefilled in chunks beside other requests' decode steps), on a second engine
    sharing `engine`'s model: each equals its run alone, and every block comes back."""
    eng = Engine(engine.checkpoint_dir, model=engine.model, kv_cache_tokens=2048, max_num_tokens=16,
                 return_logits=True)
    jobs = []
    for i, name in enumerate(requests):
        jobs.append((name, SamplingParams(max_tokens=10 + i)))
        jobs.append((name, SamplingParams(max_tokens=12 - i, temperature=0.9, top_k=50, top_p=0.9, seed=7 + i)))
    try:
        alone = [submit(eng, requests[n], p, f"alone-{i}").wait() for i, (n, p) in enumerate(jobs)]
        seen_running = []
        cols = [submit(eng, requests[n], p, f"conc-{i}", on_emit=lambda c: seen_running.append(eng.num_running))
                for i, (n, p) in enumerate(jobs)]
        together = [c.wait() for c in cols]
        assert_same(together, alone)
        assert max(seen_running) > 1  # they really did run at the same time
        assert eng.kv_blocks_used == 0 and (eng.num_running, eng.num_waiting) == (0, 0)
    finally:
        eng.shutdown()


def assert_same(together, alone, atol=1e-4):
    """Tokens equal; logits of every step within `atol` (batched matmuls sum in another order, so
    rows are not bitwise batch-invariant on CPU: see bench/RESULTS.md)."""
    for t, a in zip(together, alone):
        assert t.ids == a.ids and t.finish_reason == a.finish_reason
        for ot, oa in zip(t.outputs, a.outputs):
            if ot.logits is not None:
                assert torch.allclose(ot.logits, oa.logits, atol=atol, rtol=0), (ot.logits - oa.logits).abs().max()


@pytest.fixture(scope="module")
def batching_engine(ckpt, engine):
    """Small step budget: prompts are prefilled in chunks while others decode in the same step."""
    eng = Engine(ckpt, model=engine.model, kv_cache_tokens=4096, max_num_tokens=24, return_logits=True)
    yield eng
    eng.shutdown()


def test_eight_concurrent_requests_equal_alone(batching_engine, requests):
    eng, jobs = batching_engine, _jobs()
    alone = _alone(eng, requests, jobs, "b")
    assert eng.kv_blocks_free == eng.blocks.num_blocks
    steps = eng.num_steps
    together = _together(eng, requests, jobs, "b")
    assert_same(together, alone)
    assert eng.num_steps - steps < sum(len(a.ids) for a in alone)  # rows of many requests shared steps
    assert eng.kv_blocks_free == eng.blocks.num_blocks and eng.kv_blocks_used == 0
    assert (eng.num_running, eng.num_waiting) == (0, 0)


def test_steps_apart_give_the_same_answers_and_never_mix(ckpt, engine, batching_engine, requests):
    """`mixed_steps` off (prompt chunks and decodes in steps of their own, so that on CUDA every
    decode-only step replays a graph): the eight concurrent requests answer as alone, and no step
    holds both kinds."""
    eng = Engine(ckpt, model=engine.model, kv_cache_tokens=4096, max_num_tokens=24, return_logits=True,
                 mixed_steps=False)
    kinds, real = [], eng.runner.forward

    def spy(chunks):
        kinds.append({c.is_decode for c in chunks})
        return real(chunks)

    eng.runner.forward = spy
    try:
        jobs = _jobs()
        assert_same(_together(eng, requests, jobs, "apart"), _alone(batching_engine, requests, jobs, "mixed"))
    finally:
        eng.shutdown()
    assert {True} in kinds and {False} in kinds and all(len(k) == 1 for k in kinds)
    assert eng.kv_blocks_used == 0


def test_batched_step_mixes_prefill_chunks_and_decodes(ckpt, engine, requests):
    eng = Engine(ckpt, model=engine.model, kv_cache_tokens=4096, max_num_tokens=16)
    seen = []
    real = eng.runner.forward
    second_in = threading.Event()

    def spy(chunks):  # the engine's forward passes watched
        seen.append([(c.start, c.num_tokens) for c in chunks])
        if any(c.num_tokens == 1 for c in chunks):  # `first` decodes: hold it until `second` is queued
            assert second_in.wait(60)
        return real(chunks)

    eng.runner.forward = spy
    try:
        first = submit(eng, requests["text"], SamplingParams(max_tokens=20), "first")
        while not first.outputs:
            first.done.wait(0.01)
        second = submit(eng, requests["video"], SamplingParams(max_tokens=4), "second")
        second_in.set()
        first.wait(), second.wait()
    finally:
        eng.shutdown()
    # some step ran a decode row of `first` beside a prefill chunk (start > 0 or many rows) of `second`
    assert any(len(step) > 1 and any(n == 1 for _, n in step) and any(n > 1 for _, n in step) for step in seen)
    assert max(sum(n for _, n in step) for step in seen) <= 16  # the per-step token budget


def test_cancel_and_finish_return_every_block(batching_engine, requests):
    eng = batching_engine
    cols = [Collector() for _ in PROMPTS]
    for i, name in enumerate(PROMPTS):
        eng.submit(f"c-{i}", **requests[name]["llm"], params=SamplingParams(max_tokens=30), emit=cols[i],
                   is_cancelled=(lambda i=i: len(cols[i].outputs) >= 2) if i % 2 else (lambda: False))
    reasons = [c.wait().finish_reason for c in cols]
    assert reasons[1::2] == ["cancelled", "cancelled"] and all(r in ("stop", "length") for r in reasons[::2])
    assert eng.kv_blocks_free == eng.blocks.num_blocks and eng.kv_blocks_used == 0


def test_prefix_cache_hit_equals_miss(ckpt, engine, requests):
    eng = Engine(ckpt, model=engine.model, kv_cache_tokens=2048, block_size=8, prefix_caching=True,
                 return_logits=True)
    try:
        for name in ("image", "image+video", "text"):
            params = SamplingParams(max_tokens=10)
            miss = submit(eng, requests[name], params, f"miss-{name}").wait()
            hits = eng.blocks.hits
            hit = submit(eng, requests[name], params, f"hit-{name}").wait()
            assert eng.blocks.hits > hits  # blocks really were reused
            assert_same([hit], [miss])
            assert eng.kv_blocks_free == eng.blocks.num_blocks
        # same token ids, other embedding rows: no false hit
        llm = dict(requests["image"]["llm"], embeddings=requests["image"]["llm"]["embeddings"] + 1.0)
        other = Collector()
        eng.submit("other", **llm, params=SamplingParams(max_tokens=10), emit=other)
        nocache = Engine(ckpt, model=engine.model, kv_cache_tokens=2048, block_size=8)
        ref = Collector()
        nocache.submit("ref", **llm, params=SamplingParams(max_tokens=10), emit=ref)
        assert other.wait().ids == ref.wait().ids
        nocache.shutdown()
    finally:
        eng.shutdown()


def test_preemption_under_small_pool_gives_same_tokens(ckpt, engine, batching_engine, requests):
    jobs = _jobs()
    alone = _alone(batching_engine, requests, jobs, "p")
    longest = max(int(requests[n]["llm"]["input_ids"].size) + p.max_tokens for n, p in jobs)
    eng = Engine(ckpt, model=engine.model, kv_cache_tokens=longest + 16, block_size=8, max_num_tokens=24,
                 return_logits=True)
    try:
        together = _together(eng, requests, jobs, "p")
        assert eng.num_preempted > 0
        assert_same(together, alone)
        assert eng.kv_blocks_free == eng.blocks.num_blocks
    finally:
        eng.shutdown()


def test_repetition_penalty_matches_hf(hf, engine, requests):
    req = requests["image"]
    expected = hf_generate(hf, req, max_new_tokens=12, do_sample=False, repetition_penalty=1.5)
    assert submit(engine, req, SamplingParams(max_tokens=12, repetition_penalty=1.5), "rp").wait().ids == expected
    torch.manual_seed(99)
    expected = hf_generate(hf, req, max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20, top_p=0.95,
                           repetition_penalty=1.3)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, top_p=0.95, repetition_penalty=1.3, seed=99)
    assert submit(engine, req, params, "rp-seeded").wait().ids == expected


def test_request_larger_than_pool_is_invalid_before_taking_blocks(ckpt, engine, requests):
    eng = Engine(ckpt, model=engine.model, kv_cache_tokens=16, block_size=16)
    try:
        with pytest.raises(InvalidInput, match="KV cache pool holds 16 tokens"):
            submit(eng, requests["video"], SamplingParams(max_tokens=16), "too-big")
        assert eng.kv_blocks_free == eng.blocks.num_blocks and eng.num_waiting == 0
    finally:
        eng.shutdown()


# ---- validation -------------------------------------------------------------------------------------

def test_over_context_rejected(engine, requests):
    ctx = engine.context_length
    ids = np.full(ctx + 10, requests["text"]["llm"]["input_ids"][-1], np.int32)
    with pytest.raises(InvalidInput, match=f"prompt is {ctx + 10} tokens, context is {ctx}"):
        engine.submit("long", ids, None, None, None, SamplingParams(max_tokens=1), emit=lambda o: None)
    ids = ids[:ctx - 5]
    with pytest.raises(InvalidInput, match=f"prompt is {ctx - 5} tokens and max_tokens is 10, context is {ctx}"):
        engine.submit("long2", ids, None, None, None, SamplingParams(max_tokens=10), emit=lambda o: None)
    assert engine.num_waiting == 0


def test_embeddings_count_mismatch(engine, requests):
    llm = dict(requests["image"]["llm"])
    n = llm["embeddings"].shape[0]
    llm["embeddings"] = llm["embeddings"][:-1]
    with pytest.raises(InvalidInput, match=rf"embeddings: {n - 1} rows given, prompt has {n} "):
        engine.submit("mismatch", **llm, params=SamplingParams(max_tokens=2), emit=lambda o: None)
    with pytest.raises(InvalidInput, match="embeddings"):
        prompt_logits(engine.model, torch.from_numpy(llm["input_ids"]), torch.from_numpy(llm["embeddings"]),
                                   torch.from_numpy(llm["mrope_position_ids"]))
    llm = dict(requests["image"]["llm"], mrope_position_ids=np.zeros((3, 2), np.int64))
    with pytest.raises(InvalidInput, match="mrope_position_ids"):
        engine.submit("badpos", **llm, params=SamplingParams(max_tokens=2), emit=lambda o: None)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens: must be >= 1, got 0"),
    (dict(max_tokens=4, temperature=-1), "temperature: must be >= 0, got -1"),
    (dict(max_tokens=4, temperature=float("nan")), "temperature"),
    (dict(max_tokens=4, top_p=0.0), r"top_p: must be in \(0, 1\], got 0.0"),
    (dict(max_tokens=4, top_p=1.5), "top_p"),
    (dict(max_tokens=4, top_k=-1), "top_k: must be >= 0, got -1"),
    (dict(max_tokens=4, seed=-1), "seed"),
    (dict(max_tokens=4, seed=2 ** 64), "seed"),
    (dict(max_tokens=4, stop_words="x"), "stop_words"),
    (dict(max_tokens=4, repetition_penalty=0.0), "repetition_penalty: must be > 0"),
])
def test_bad_sampling_values(kwargs, message):
    with pytest.raises(InvalidInput, match=message):
        SamplingParams(**kwargs)


def test_from_inputs():
    p = SamplingParams.from_inputs({
        "max_tokens": np.array([7], np.int32), "temperature": np.array([0.5], np.float32),
        "top_p": np.array([0.8], np.float32), "top_k": np.array([5], np.int32),
        "seed": np.array([2 ** 64 - 1], np.uint64), "stop_words": np.array([b"end", "é".encode()], object)})
    assert (p.max_tokens, p.top_k, p.seed, p.stop_words) == (7, 5, 2 ** 64 - 1, ["end", "é"])
    assert p.temperature == pytest.approx(0.5) and p.top_p == pytest.approx(0.8)
    assert SamplingParams.from_inputs({"max_tokens": [3]}) == SamplingParams(max_tokens=3)
    with pytest.raises(InvalidInput, match="max_tokens: required"):
        SamplingParams.from_inputs({})
    # tensorrtllm_backend's convention: 0 leaves temperature / top_p / top_k unset
    assert SamplingParams.from_inputs({"max_tokens": [3], "temperature": [0.0], "top_p": [0.0], "top_k": [0]}) \
        == SamplingParams(max_tokens=3)
    assert SamplingParams.from_inputs({"max_tokens": [3], "stop_words": np.array([b"\xffend"], object)}).stop_words \
        == ["\ufffdend"]
    with pytest.raises(InvalidInput, match=r"stop_words\[0\]: must be a non-empty string"):
        SamplingParams.from_inputs({"max_tokens": [3], "stop_words": np.array([b""], object)})
    with pytest.raises(InvalidInput, match="temperature: must be >= 0"):
        SamplingParams.from_inputs({"max_tokens": [3], "temperature": np.array([-2.0])})


def test_incremental_detokenizer_never_emits_broken_utf8(engine):
    tok = engine.tokenizer
    text = "a é 🙂 cat 日本"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.split())  # multi-byte characters span several byte tokens
    detok = IncrementalDetokenizer(tok, [])
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
