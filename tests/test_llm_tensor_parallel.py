"""Issue #31 on the CPU: the llm split over 2 and 4 ranks (worker processes, gloo) gives the tokens
and logits of the unsplit model, float32 within 1e-5: Qwen2.5-VL (KV heads split, and at 4 ranks
replicated), GLM-4.1V (interleaved partial rotary, fused gate_up, one KV head replicated), GLM-4.5V
(routed experts split by expert, shared experts by width), Qwen3-VL-MoE (softmax-routed experts, the
image rows' DeepStack maps broadcast to every rank), Qwen3.5-MoE (every layer, linear or full
attention, with routed experts split by expert and the sigmoid-gated shared expert by width), MiniCPM-V 4.6 (Gated DeltaNet layers
by head, their states per rank, beside gated full attention), MiniCPM-V 4.0 (Llama heads wider
than the model's width split, LongRoPE) and Gemma 3 (sliding windows, an image block attending both
ways on every rank), text and image prompts, several
requests at once, prompts in chunks. A killed worker ends the requests with an error naming it,
and the engine refuses new ones; a decoder that does not split is refused at start (and by the
build). Behind a real tritonserver (`build --tensor-parallel 2`, the llm's ranks spawned by
its stub), the ensemble's greedy tokens for text, image and video prompts are `generate`'s, and a
rank killed under load ends its requests and the llm is reloaded by `serve`'s supervisor."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_llm import Collector, submit
from triton_vlm.llm import Engine, SamplingParams

PROMPTS = ["the red car on the road", "a dog runs over the bridge in the rain", "count the trees", "hi"]
ATOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from triton_vlm.families.demo import write_demo_checkpoint

    root = tmp_path_factory.mktemp("tensor_parallel")
    # MiniCPM-V 4.0's Llama: 2 x 128 wide heads on a 256 wide model, LongRoPE (its tiny demo's 3 heads do not split).
    overrides = {"minicpmv4_0": {"text": {"num_attention_heads": 4, "num_key_value_heads": 2}}}
    return {family: write_demo_checkpoint(family, root / family, "tiny", overrides=overrides.get(family))
            for family in ("qwen2_5_vl", "glm4v", "glm4v_moe", "minicpmv4_6", "minicpmv4_0", "qwen3_vl_moe",
                           "qwen3_5_moe", "gemma3")}


def requests(engine: Engine) -> list[dict]:
    """Text prompts, and one with image rows at its placeholders (random rows: the decoder's view)."""
    c = engine.config
    out = [dict(input_ids=engine.tokenizer.encode(p).ids, embeddings=None, mrope_position_ids=None,
                mrope_position_delta=None) for p in PROMPTS]
    image = c.placeholder_token_ids[0]
    ids = engine.tokenizer.encode("look at").ids + [image] * 6 + engine.tokenizer.encode("and say").ids
    rows = torch.randn(6, c.embedding_width, generator=torch.Generator().manual_seed(3)).numpy()
    n = len(ids)
    out.append(dict(input_ids=np.array(ids, np.int32), embeddings=rows,
                    mrope_position_ids=np.broadcast_to(np.arange(n), (3, n)).copy(), mrope_position_delta=np.zeros(1)))
    return out


def generate(engine: Engine, tag: str) -> list[Collector]:
    cols = [submit(engine, {"llm": r}, SamplingParams(max_tokens=8), f"{tag}-{i}")
            for i, r in enumerate(requests(engine))]
    return [c.wait() for c in cols]


@pytest.mark.parametrize("family, ranks", [("qwen2_5_vl", 2), ("qwen2_5_vl", 4), ("glm4v", 2), ("glm4v_moe", 2),
                                           ("minicpmv4_6", 2), ("minicpmv4_0", 2), ("qwen3_vl_moe", 2),
                                           ("qwen3_5_moe", 2), ("gemma3", 2)])
def test_split_model_gives_the_whole_models_tokens_and_logits(checkpoints, family, ranks):
    settings = dict(return_logits=True, max_num_tokens=12, max_running=8)  # prompts of several chunks
    whole = Engine(checkpoints[family], **settings)
    try:
        expected = generate(whole, "whole")
    finally:
        whole.shutdown()
    split = Engine(checkpoints[family], tensor_parallel=ranks, **settings)
    try:
        assert split.model.config.num_heads == whole.model.config.num_heads // ranks
        for ref, ours in zip(expected, generate(split, "split")):
            assert ours.ids == ref.ids and ours.outputs[-1].finish_reason == ref.outputs[-1].finish_reason
            for a, b in zip(ref.outputs, ours.outputs):
                assert float((a.logits - b.logits).abs().max()) <= ATOL
        assert split.kv_blocks_used == 0
    finally:
        split.shutdown()
    assert all(not p.is_alive() for p in split.runner.workers.processes)


def listening_addresses(pid: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) of the TCP sockets `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # (closed meanwhile)
            if (target := os.readlink(f"/proc/{pid}/fd/{fd}")).startswith("socket:["):
                inodes.add(target[8:-1])
    addresses = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                addresses.add(fields[1].rsplit(":", 1)[0])
    return addresses


def test_the_group_listens_on_the_loopback_only(checkpoints):
    """Rank 0's store and every rank's connections listen on 127.0.0.1 only: no client elsewhere
    can reach the group (torch's own TCPStore would listen on every interface)."""
    engine = Engine(checkpoints["qwen2_5_vl"], tensor_parallel=2)
    try:
        for pid in (os.getpid(), engine.runner.workers.processes[0].pid):
            addresses = listening_addresses(pid)
            assert addresses and addresses <= {"0100007F"}, (pid, addresses)  # 127.0.0.1
    finally:
        engine.shutdown()


def test_a_killed_worker_fails_its_requests_and_the_engine(checkpoints):
    engine = Engine(checkpoints["qwen2_5_vl"], tensor_parallel=2)
    try:
        worker = engine.runner.workers.processes[0]
        started = Collector(on_emit=lambda col: len(col.outputs) == 4 and os.kill(worker.pid, signal.SIGKILL))
        request = requests(engine)[0]
        engine.submit("long", **request, params=SamplingParams(max_tokens=400, min_tokens=400), emit=started)
        final = started.wait().outputs[-1]
        assert final.finish_reason == "error" and "rank 1 exited (code -9)" in final.error
        assert engine.failed and "rank 1 exited" in engine.failed
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            submit(engine, {"llm": request}, SamplingParams(max_tokens=2), "after")
        assert engine.kv_blocks_used == 0
    finally:
        engine.shutdown()


def test_a_decoder_that_does_not_split_is_refused_at_start(checkpoints):
    with pytest.raises(ValueError, match="tensor parallel 4: 2 linear-attention key heads do not split evenly"):
        Engine(checkpoints["minicpmv4_6"], tensor_parallel=4)
    with pytest.raises(ValueError, match="tensor parallel 3: 4 attention heads do not split evenly"):
        Engine(checkpoints["qwen2_5_vl"], tensor_parallel=3)


def test_served_split_llm_gives_generates_tokens(checkpoints, tmp_path_factory):
    from tests.oracle import Oracle
    from tests.servers import served
    from tests.test_e2e import assert_served_tokens
    from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL
    from triton_vlm.media import samples
    from triton_vlm.repository.build import build_repository
    from triton_vlm.repository.options import BuildOptions

    checkpoint = checkpoints["qwen2_5_vl"]
    with pytest.raises(ValueError, match="--tensor-parallel 3: tensor parallel 3: 4 attention heads"):
        build_repository(checkpoint, tmp_path_factory.mktemp("refused") / "repository", BuildOptions(tensor_parallel=3))
    oracle = Oracle(checkpoint)
    image, video = samples.image_bytes(64, 48), samples.video_bytes(seconds=1.0, fps=4, width=64, height=48)
    img, vid = QWEN2_5_VL.image_placeholder, QWEN2_5_VL.video_placeholder
    prompts = {"text": ("count the trees", [], []), "image": (img + "what is this?", [image], []),
               "image+video": (img + vid + "compare them", [image], [video])}
    with served(checkpoint, tmp_path_factory, "tp2", BuildOptions(tensor_parallel=2)) as server:
        for prompt, images, videos in prompts.values():
            expected = oracle.generate(oracle.inputs(prompt, images, videos), 8)
            assert_served_tokens(server, (prompt, images, videos), expected, 8)


def test_a_dead_rank_under_serve_ends_its_requests_and_the_llm_is_reloaded(tiny_checkpoint, tmp_path, hf):
    """Under load, rank 1 of the served llm (a process its stub spawned) is SIGKILLed: requests in
    flight end within 5 s with an error (the rank named, or the llm step restarted), the llm stub
    exits, `serve`'s supervisor reloads the model with new ranks, and later requests get
    transformers' tokens again."""
    from tests.test_faults import _children
    from tests.test_step_faults import IMAGE, PROMPT, Load, N, check_recovery, supervised_server, wait_for_event
    from triton_vlm.repository.build import build_repository
    from triton_vlm.repository.options import BuildOptions

    repo = build_repository(tiny_checkpoint, tmp_path / "repository", BuildOptions(tensor_parallel=2))
    expected = hf.generate(hf.inputs(PROMPT, [IMAGE]), N)
    with supervised_server(repo, tmp_path / "server.log") as supervised, Load(supervised.server) as load:
        server, events = supervised.server, supervised.events
        stub = next(pid for pid, name in server.stub_processes().items() if name == "llm_0_0")
        rank1 = next(pid for pid in _children(stub) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes())
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        event, back = wait_for_event(events, 0, "model 'llm' reloaded", "tritonserver restarted")
        time.sleep(4.0)
        failed = check_recovery(load.stop(), killed, back, expected)
        assert event == "model 'llm' reloaded", "\n".join(events)
        assert failed and all("rank 1 exited" in o.error or "the llm step restarted" in o.error for o in failed), failed
        assert any("rank 1 exited (code -9)" in o.error for o in failed), failed
