"""The llm engine's CUDA paths (marked `gpu`; run with `pytest -m gpu` on a GPU machine): the paged
decode kernel against the gathered-SDPA reference backend, and decode steps replayed from CUDA
graphs against the same steps run eagerly. (tests/test_llm_dtype.py and tests/test_sampling.py
compare the CUDA engine, graphs on, with transformers on CUDA.)"""
from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests.test_llm_dtype import tolerance
from triton_vlm.llm import Engine, SamplingParams
from triton_vlm.llm.attention import SeqRows, TorchAttention
from triton_vlm.llm.paged import KVCache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["describe the red car on the road", "a small dog runs over the bridge in the morning rain",
           "count the trees", "what colour is the sky at dusk over the quiet city and why",
           "name three rivers", "the cat sleeps", "write one long sentence about light and dark clouds",
           "hello"]


def _paged(lengths: list[int], block_size: int, num_blocks: int) -> list[SeqRows]:
    """One decode row per length (its token `length - 1`), blocks taken from a shuffled pool."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    seqs, taken = [], 0
    for row, n in enumerate(lengths):
        nb = -(-n // block_size)
        seqs.append(SeqRows(row, 1, n - 1, order[taken:taken + nb]))
        taken += nb
    return seqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(28, 4, 128), (8, 2, 64), (4, 4, 80), (16, 1, 128)])
@pytest.mark.parametrize("rows", [6, 300])
def test_paged_decode_kernel_matches_gathered_sdpa(dtype, heads, kv_heads, head_dim, rows):
    """Contexts of 1 token, within one block, on block edges and over many shuffled blocks; 6 rows
    (the context split over programs, `num_splits` > 1) and 300 (one program per row and KV head). In
    float32 the kernel equals the reference to 1e-5 (IEEE dot products); in half precision its error
    against a float64 computation from the same inputs is at most twice SDPA's own in that dtype
    (or one ulp of the largest output)."""
    from triton_vlm.llm.cuda_attention import TritonAttention, num_splits

    torch.manual_seed(0)
    block_size, num_blocks = 16, 4096
    config = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    lengths = [1, 15, 16, 17, 300, 1000] + torch.randint(1, 200, (rows - 6,)).tolist()
    assert (num_splits(rows * kv_heads, torch.device("cuda")) > 1) == (rows == 6)
    seqs = _paged(lengths, block_size, num_blocks)
    kv = KVCache(1, kv_heads, head_dim, num_blocks, block_size, dtype, "cuda")
    kv.k.normal_(), kv.v.normal_()
    q = torch.randn(len(seqs), heads, head_dim, device="cuda", dtype=dtype)

    def decode(backend: type, kv: KVCache, q: torch.Tensor) -> torch.Tensor:
        attention = backend(config, kv)
        return attention.decode(0, q, attention.decode_metadata(seqs)).double()

    ours, ref = decode(TritonAttention, kv, q), decode(TorchAttention, kv, q)
    if dtype == torch.float32:
        assert float((ours - ref).abs().max()) <= 1e-5
        return
    exact_kv = KVCache(1, kv_heads, head_dim, num_blocks, block_size, torch.float64, "cuda")
    exact_kv.k.copy_(kv.k), exact_kv.v.copy_(kv.v)
    exact = decode(TorchAttention, exact_kv, q.double())
    ulp = torch.finfo(dtype).eps * float(exact.abs().max())
    ours_err, ref_err = float((ours - exact).abs().max()), float((ref - exact).abs().max())
    assert ours_err <= max(2 * ref_err, ulp), (ours_err, ref_err)


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
    """Within one ulp of torch's ops: the kernel rounds each product and their sum to the dtype
    where torch does, but Triton may contract a product and a sum into one fused multiply-add
    (measured on an H100: about 1 element in 3 differs by one ulp in float32). q is a view into a
    fused q/k/v output (strided rows), as the model passes it."""
    from triton_vlm.llm import cuda_ops
    from triton_vlm.llm.model import HalfPairs, InterleavedPairs, Rotary

    pairs = {"half": HalfPairs, "interleaved": InterleavedPairs}[pairing]
    config = SimpleNamespace(rotary_dim=rotary_dim, head_dim=head_dim, mrope_section=(rotary_dim // 2, 0, 0),
                             mrope_interleaved=False, rope_theta=1e6)
    rope = Rotary(config, pairs, torch.device("cuda"), dtype)
    positions = torch.randint(0, 5000, (3, 37), device="cuda")
    cos, sin = (t[:, None] for t in rope.cos_sin(positions))
    fused = torch.randn(37, 6 * head_dim, device="cuda", dtype=dtype)
    q = fused[:, :4 * head_dim].view(37, 4, head_dim)
    ours, ref = cuda_ops.rotary(q, cos, sin, pairs.interleaved).float(), rope.apply_torch(q, cos, sin).float()
    assert float((ours - ref).abs().max()) <= torch.finfo(dtype).eps * float(ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_f32", [False, True])
@pytest.mark.parametrize("shape", [(5, 3584), (7, 4, 128), (1, 1000)])
def test_rms_norm_kernel_matches_torch(dtype, weight_f32, shape):
    """In half precision within one ulp of torch's ops and equal almost everywhere: only the order of
    the float32 sum of squares differs, and the cast to the dtype hides it. In float32 nothing hides
    it, and Triton's rsqrt is the fast approximate one: within 8 ulps (measured: 4)."""
    from triton_vlm.llm import cuda_ops
    from triton_vlm.llm.model import rms_torch

    x = torch.randn(shape, device="cuda", dtype=dtype) * 3
    weight = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(torch.float32 if weight_f32 else dtype)
    ours, ref = cuda_ops.rms_norm(x, weight, 1e-6).float(), rms_torch(x, weight, 1e-6).float()
    ulps = 8 if dtype == torch.float32 else 1
    assert float((ours - ref).abs().max()) <= ulps * torch.finfo(dtype).eps * float(ref.abs().max())
    if dtype != torch.float32:
        assert float((ours == ref).float().mean()) >= 0.99
