"""Issue #41 end to end: MiniCPM-V 4.0 (`minicpmv4_0`: the official `MiniCPMV` class of version 4.0,
SigLIP-NaViT and the 2-D resampler on Llama with LongRoPE) behind a real tritonserver, served from
the official golden checkpoint as it is (`tests/golden/minicpmv4_0`: the official remote code
under transformers 4.51.3, torch 2.1.2): every case's ids (`<s>` first), image bounds, `tgt_sizes`
and pixels, resampler rows (ONNX and torch), logits (LongRoPE's frequencies) and greedy tokens are
the official ones (`tests.minicpmv_golden.GoldenChecks`)."""
from tests.minicpmv_golden import SETS, GoldenChecks, pytest_generate_tests  # noqa: F401 (pytest's hook)


class TestMiniCPMV4_0(GoldenChecks):
    GOLDEN = SETS["minicpmv4_0"]
