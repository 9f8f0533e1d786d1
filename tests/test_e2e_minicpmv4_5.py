"""Issue #27 end to end: MiniCPM-V 4.5 behind a real tritonserver, served from the official golden
checkpoint (`tests/golden/minicpmv4_5`, its config respelled: `write_golden_variant`; transformers
has no class for it, so the official code's recorded outputs are the oracle): every check the
remote-code versions pass (`tests.minicpmv_golden.GoldenChecks`: the official ids, pixels,
resampler rows, logits and greedy tokens), the MP4 too, sent as a client sends it, its packed
frames resampled with their temporal ids. A video request over a limit is INVALID_ARG naming it,
and the server goes on serving."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from tests.minicpmv_golden import SETS, GoldenChecks, close, pytest_generate_tests  # noqa: F401 (pytest's hook)
from tests.test_e2e import grpc_tokens, infer_direct, media_values

GOLDEN = SETS["minicpmv4_5"]
VIDEO = GOLDEN.cases["d_video"]
PACKED = {"force_packing": VIDEO["video"]["force_packing"]}  # as the golden run


class TestMiniCPMV4_5(GoldenChecks):
    GOLDEN = GOLDEN

    @classmethod
    def served_checkpoint(cls, root: Path) -> Path:
        """The golden checkpoint, its config respelled as the official code reads it alike
        (tests/config_variants.py: `dtype`, the keys its classes default left out)."""
        from tests.config_variants import write_golden_variant

        return write_golden_variant(GOLDEN.root, root / "checkpoint")

    @classmethod
    def served(cls, case: str) -> tuple[str, list[bytes], list[bytes], dict | None]:
        """A case as a client sends it: the video as its MP4 file behind one `(<video>./</video>)`
        marker where the official chat wrote its frames' `(<image>./</image>)` lines."""
        if case != "d_video":
            return super().served(case)
        frames = "\n".join(["(<image>./</image>)"] * len(VIDEO["video"]["frame_indices"]))
        return (VIDEO["prompt"].replace(frames, "(<video>./</video>)"), [],
                [(GOLDEN.root / VIDEO["media"][0]["file"]).read_bytes()], PACKED)

    @classmethod
    def served_cases(cls) -> list[str]:
        return list(GOLDEN.cases)

    def test_a_video_gives_the_official_ids_and_packed_rows(self, server):
        out = infer_direct(server, "preprocess", media_values(*self.served("d_video")),
                           ["input_ids", "pixel_values", "grid_thw", "temporal_ids"])
        np.testing.assert_array_equal(out["input_ids"], GOLDEN.values["d_video/input_ids"].reshape(-1))
        np.testing.assert_array_equal(np.repeat(out["grid_thw"][:, 1:], out["grid_thw"][:, 0], axis=0),
                                      VIDEO["tgt_sizes"])
        rows = infer_direct(server, "vision_encoder", {"pixel_values": (out["pixel_values"], "FP32"),
                                                       "grid_thw": (out["grid_thw"], "INT64"),
                                                       "temporal_ids": (out["temporal_ids"], "INT64")},
                            ["embeddings"])["embeddings"]
        close(rows, GOLDEN.values["d_video/vision_embeds"])

    @pytest.mark.parametrize("mm_options, refusal", [
        ({"max_frames": 10_000}, r"^mm_options: max_frames=10000 exceeds max_frames=768$"),
        ({"num_frames": 4}, r"^videos\[0\]: num_frames: MiniCPM-V 4.5 chooses frames by fps"),
    ])
    def test_a_video_over_a_limit_is_invalid_arg_and_the_server_keeps_serving(self, server, mm_options, refusal):
        from triton_vlm.clients.client import RequestError

        prompt, images, videos, _ = self.served("d_video")
        with pytest.raises(RequestError, match=refusal):  # (a gRPC stream carries the message alone)
            grpc_tokens(server, prompt, images, videos, max_tokens=4, mm_options=mm_options)
        with pytest.raises(InferenceServerException) as direct:
            infer_direct(server, "preprocess", media_values(prompt, images, videos, mm_options), ["input_ids"])
        assert direct.value.status() == "StatusCode.INVALID_ARGUMENT" and re.match(refusal, direct.value.message())
        assert grpc_tokens(server, prompt, images, videos, max_tokens=8, mm_options=PACKED) == \
            GOLDEN.values["d_video/gen_tokens"].tolist()
