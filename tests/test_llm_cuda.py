"""The llm engine's CUDA paths (marked `gpu`; run with `pytest -m gpu` on a GPU machine): the Triton
kernels at full sizes against their torch references (tests/kernel_checks.py; the same checks run
small under Triton's interpreter in tests/test_kernels_interpret.py), and decode steps replayed from CUDA
graphs against the same steps run eagerly. (tests/test_llm_dtype.py and tests/test_sampling.py
compare the CUDA engine, graphs on, with transformers on CUDA.)"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests.kernel_checks import check_attention_step, check_paged_decode, check_rms_norm, check_rotary
from tests.test_llm_dtype import tolerance
from triton_vlm.llm import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["describe the red car on the road", "a small dog runs over the bridge in the morning rain",
           "count the trees", "what colour is the sky at dusk over the quiet city and why",
           "name three rivers", "the cat sleeps", "write one long sentence about light and dark clouds",
           "hello"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(28, 4, 128), (8, 2, 64), (4, 4, 80), (16, 1, 128)])
@pytest.mark.parametrize("rows", [6, 300])
def test_paged_decode_kernel_matches_gathered_sdpa(dtype, heads, kv_heads, head_dim, rows):
    """Contexts of 1 token, within one block, on block edges and over many shuffled blocks; 6 rows
    (the context split over programs, `num_splits` > 1) and 300 (one program per row and KV head)."""
    from triton_vlm.llm.attention.cuda import num_splits

    torch.manual_seed(0)
    lengths = [1, 15, 16, 17, 300, 1000] + torch.randint(1, 200, (rows - 6,)).tolist()
    assert (num_splits(rows * kv_heads, torch.device("cuda")) > 1) == (rows == 6)
    check_paged_decode("cuda", dtype, heads, kv_heads, head_dim, lengths, block_size=16, num_blocks=4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(28, 4, 128), (8, 2, 64), (4, 4, 80), (16, 1, 128)])
def test_paged_prefill_kernel_matches_sdpa_in_a_mixed_step(dtype, heads, kv_heads, head_dim):
    """A step of prompt chunks from token 0 and over cached prefixes (chunked prefill, prefix-cache
    hits), decode rows between them, at 7B-like sizes."""
    check_attention_step("cuda", dtype, heads, kv_heads, head_dim,
                         [(0, 512), (700, 1), (1000, 96), (0, 17), (33, 256), (5, 1), (2048, 1)],
                         block_size=16, num_blocks=4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 64, 1024])
def test_paged_kernels_with_sliding_windows_and_bidirectional_spans(dtype, window):
    """Gemma 3's masks at its sizes (8 heads, 4 KV heads of 256): image blocks of 256 tokens seeing
    each other both ways in prefill (one continuing after a cached prefix), sliding-window layers in
    prefill and decode, beside full ones."""
    check_attention_step("cuda", dtype, 8, 4, 256, [(0, 600, (10, 266), (300, 556)), (700, 1), (1000, 300, (900, 1156)),
                                                    (2048, 1)], block_size=16, num_blocks=4096, window=window)
    check_paged_decode("cuda", dtype, 8, 4, 256, [1, 15, 300, 1000, 3000], block_size=16, num_blocks=4096,
                       window=window)


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def engines(request, tiny_checkpoint):
    """The same model on CUDA, decoding eagerly and from CUDA graphs."""
    eager = Engine(tiny_checkpoint, device="cuda", dtype=request.param, cuda_graphs=False, return_logits=True,
                   max_running=8)
    graphs = Engine(tiny_checkpoint, model=eager.model, cuda_graphs=True, return_logits=True, max_running=8)
    yield eager, graphs
    eager.shutdown()
    graphs.shutdown()


def _text_request(engine: Engine, prompt: str) -> dict:
    """A text-only llm request, as `tests.test_llm.submit` takes it."""
    return {"llm": dict(input_ids=engine.tokenizer.encode(prompt).ids, embeddings=None, mrope_position_ids=None,
                        mrope_position_delta=None)}


def _generate(engine: Engine, tag: str, max_tokens: int = 24):
    from tests.test_llm import submit

    cols = [submit(engine, _text_request(engine, p), SamplingParams(max_tokens=max_tokens), f"{tag}-{i}")
            for i, p in enumerate(PROMPTS)]
    return [c.wait() for c in cols]


def test_cuda_graph_decode_equals_eager(engines):
    """Eight requests at once (the batch shrinks as they end, so several buckets and their padding
    rows are used): every step's logits within one ulp at the largest logit (`tolerance`; the graphs
    run the batch padded to its bucket, and cuBLAS may tile another batch size otherwise), tokens
    equal until a step whose top-2 gap is within twice that; every block back afterwards."""
    eager, graphs = engines
    assert eager.runner.graphs is None and graphs.runner.graphs is not None
    replays = graphs.runner.graphs.num_replays
    compared = 0
    for ref, ours in zip(_generate(eager, "eager"), _generate(graphs, "graphs")):
        for step, (a, b) in enumerate(zip(ref.outputs, ours.outputs)):
            tol = tolerance(a.logits)
            assert float((a.logits - b.logits).abs().max()) <= tol, f"step {step}"
            top2 = a.logits.topk(2).values
            if float(top2[0] - top2[1]) <= 2 * tol:
                break
            assert a.token_ids == b.token_ids
            compared += 1
        else:
            assert ref.ids == ours.ids
    assert compared >= 16
    assert graphs.runner.graphs.num_replays - replays >= 20
    for engine in engines:
        assert engine.kv_blocks_used == 0


def test_paged_prefill_engine_equals_sdpa_prefill(engines, tiny_checkpoint):
    """`paged_prefill` on the same model: chunked prompts (8 tokens a step) and prefix-cache hits
    (every prompt twice) read the cache in place; logits of every step within `tolerance` of the
    SDPA-prefill engine's (3 bfloat16 ulps at the largest: another attention kernel, as between
    transformers and us on CUDA), tokens equal until a near tie."""
    eager, _ = engines
    paged = Engine(tiny_checkpoint, model=eager.model, cuda_graphs=False, return_logits=True, max_running=8,
                   max_num_tokens=8, prefix_caching=True, paged_prefill=True)
    try:
        for _ in range(2):
            for ref, ours in zip(_generate(eager, "sdpa"), _generate(paged, "paged")):
                for a, b in zip(ref.outputs, ours.outputs):
                    tol = tolerance(a.logits, 3)
                    assert float((a.logits - b.logits).abs().max()) <= tol
                    top2 = a.logits.topk(2).values
                    if float(top2[0] - top2[1]) <= 2 * tol:
                        break
                    assert a.token_ids == b.token_ids
        assert paged.kv_blocks_used == 0
    finally:
        paged.shutdown()


def test_cancel_during_graph_decode_frees_every_block(engines):
    import threading

    from tests.test_llm import submit

    _, graphs = engines
    started = threading.Event()
    col = submit(graphs, _text_request(graphs, PROMPTS[0]), SamplingParams(max_tokens=400, min_tokens=400),
                 "cancel-me", on_emit=lambda c: len(c.outputs) > 8 and started.set())
    assert started.wait(60)
    graphs.cancel("cancel-me")
    assert col.wait().finish_reason == "cancelled"
    assert graphs.kv_blocks_used == 0 and graphs.kv_blocks_free == graphs.blocks.num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pairing,head_dim,rotary_dim", [("half", 128, 128), ("interleaved", 128, 64),
                                                         ("half", 128, 64), ("interleaved", 80, 40)])
def test_rotary_kernel_equals_torch(dtype, pairing, head_dim, rotary_dim):
    check_rotary("cuda", dtype, pairing, head_dim, rotary_dim, tokens=37)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_f32", [False, True])
@pytest.mark.parametrize("shape", [(5, 3584), (7, 4, 128), (1, 1000)])
def test_rms_norm_kernel_matches_torch(dtype, weight_f32, shape):
    check_rms_norm("cuda", dtype, weight_f32, shape)
