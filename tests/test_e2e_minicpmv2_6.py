"""Issue #41 end to end: MiniCPM-V 2.6 (`minicpmv2_6`: the official `MiniCPMV` class of version 2.6,
SigLIP-NaViT and the 2-D resampler on Qwen2) behind a real tritonserver, served from the official
golden checkpoint as it is (`tests/golden/minicpmv2_6`: the official remote code under
transformers 4.40.0, torch 2.1.2): every case's ids, image bounds, `tgt_sizes` and pixels,
resampler rows (ONNX and torch), logits and greedy tokens are the official ones
(`tests.minicpmv_golden.GoldenChecks`)."""
from tests.minicpmv_golden import SETS, GoldenChecks, pytest_generate_tests  # noqa: F401 (pytest's hook)


class TestMiniCPMV2_6(GoldenChecks):
    GOLDEN = SETS["minicpmv2_6"]
