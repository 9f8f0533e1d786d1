"""Every Triton-language kernel of the llm (paged decode and its split combine, paged prefill, RMSNorm, rotary) run
on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`) against its torch reference, at small
sizes: CI checks the kernels between the sessions that are lent a GPU. The same checks run at full
size on CUDA in tests/test_llm_cuda.py (`-m gpu`).

float32 and float16 only: Triton 3.8's interpreter keeps bfloat16 as raw uint16 (numpy has no
bfloat16), so `tl.dot` multiplies the bit patterns (`create_dot`: a paged decode off by 8e8), and
its float32 -> bfloat16 cast truncates where the GPU rounds to nearest (`_convert_float`: one ulp
short in about a third of the elements). The kernels take every dtype through the same code, and
float16's casts round as the GPU's do; bfloat16 is checked on CUDA.

Run by tests/test_kernels_interpret.py in a process of its own with `TRITON_INTERPRET=1` from the
start: Triton's own `@triton.jit` functions (`tl.sum`, `tl.max`, ...) are built as the process
first imports Triton, and in a process that imported it without the variable they are compiled
functions the interpreter cannot call."""
from __future__ import annotations

import os

import pytest
import torch

from tests.kernel_checks import check_attention_step, check_paged_decode, check_rms_norm, check_rotary

DTYPES = [torch.float32, torch.float16]


@pytest.fixture(autouse=True)
def interpreted():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_kernels_interpret.py"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (3, 3, 40), (4, 1, 64)])
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_decode_kernel_matches_gathered_sdpa(dtype, heads, kv_heads, head_dim, splits):
    """Contexts of 1 token, within one block, on block edges and over many shuffled blocks (more
    than the kernel's 64 tokens a loop); the context in one program, or split over four and joined
    by the combine kernel."""
    check_paged_decode("cpu", dtype, heads, kv_heads, head_dim, [1, 7, 8, 9, 150], block_size=8, num_blocks=64,
                       splits=splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (3, 3, 40), (8, 1, 16)])
def test_paged_prefill_kernel_matches_sdpa_in_a_mixed_step(dtype, heads, kv_heads, head_dim):
    """One step of prompt chunks from token 0 (longer than a tile, on a block edge), chunks that
    continue a sequence whose earlier tokens are cached (mid-block, over more than the kernel's 32
    tokens a loop), and decode rows between them: the prefill kernel (all chunks in one launch) and
    the decode kernel against SDPA."""
    check_attention_step("cpu", dtype, heads, kv_heads, head_dim, [(0, 37), (5, 1), (45, 3), (0, 8), (70, 20), (9, 1)],
                         block_size=8, num_blocks=64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [5, 40])
def test_sliding_window_decode_kernel_matches_gathered_sdpa(dtype, window):
    """A sliding-window layer's decode rows (Gemma 3's): contexts shorter and longer than the window,
    in one program and split (splits wholly before the window stay empty)."""
    for splits in (1, 4):
        check_paged_decode("cpu", dtype, 4, 2, 32, [1, 7, 9, 150], block_size=8, num_blocks=64, splits=splits,
                           window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 6, 40])
def test_paged_prefill_kernel_with_bidirectional_spans_and_windows(dtype, window):
    """Chunks whose rows attend both ways inside spans (Gemma 3's image blocks: a chunk from token 0,
    one that continues inside a span after a cached prefix, spans longer than the window), full and
    sliding-window layers, decode rows between them: the prefill and decode kernels against SDPA with
    `TorchAttention`'s masks."""
    check_attention_step("cpu", dtype, 4, 2, 32, [(0, 37, (3, 20), (22, 30)), (5, 1), (45, 30, (40, 60), (62, 70)),
                                                  (0, 8), (9, 1)], block_size=8, num_blocks=64, window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pairing,head_dim,rotary_dim", [("half", 32, 32), ("interleaved", 32, 16),
                                                         ("half", 40, 20)])
def test_rotary_kernel_equals_torch(dtype, pairing, head_dim, rotary_dim):
    check_rotary("cpu", dtype, pairing, head_dim, rotary_dim, tokens=5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_f32", [False, True])
@pytest.mark.parametrize("shape", [(3, 96), (2, 3, 40)])
def test_rms_norm_kernel_matches_torch(dtype, weight_f32, shape):
    check_rms_norm("cpu", dtype, weight_f32, shape)
