"""The official MiniCPM-V golden sets (`tests/golden/minicpmv*/`, copies of
`shared/reference/minicpmv*/`; each README says which official code and versions made each value),
and the checks every version's set passes behind a real tritonserver (`GoldenChecks`: a
version's test module subclasses it, naming its set; one server per class)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

ATOL = 1e-4  # the READMEs' bound for a float32 run of another implementation


class GoldenSet:
    """One version's golden folder: its cases (cases.json) and golden.npz's arrays (`CASE/NAME`)."""

    def __init__(self, name: str, run_markers: tuple[str, ...] = ("<image>", "<slice>")):
        self.root = Path(__file__).parent / "golden" / name
        # The markers the official processor starts an `image_bound` run after (`_convert`): 2.5's
        # `<image>` only (its slices are `<image>` runs inside one `<slice>`).
        self.run_markers = run_markers
        self.meta = json.loads((self.root / "cases.json").read_text())
        self.cases = {case["id"]: case for case in self.meta["cases"]}
        self.image_cases = [case for case, c in self.cases.items() if all(m["kind"] == "image" for m in c["media"])]
        self.media_cases = [case for case in self.image_cases if self.cases[case]["media"]]

    @functools.cached_property
    def values(self) -> dict[str, np.ndarray]:
        with np.load(self.root / "golden.npz") as npz:
            return {key: npz[key] for key in npz.files}

    def request(self, case: str) -> tuple[str, list[bytes], list[bytes]]:
        """(prompt, images, videos) of an image case as a client sends it: the JPEG files' bytes."""
        c = self.cases[case]
        return c["prompt"], [(self.root / m["file"]).read_bytes() for m in c["media"]], []

    def special_id(self, token: str) -> int:
        return int(self.meta["tokenizer"]["special_ids"][token])


SETS = {name: GoldenSet(name) for name in ("minicpmv2_6", "minicpmv4_0", "minicpmv4_5")} | {
    name: GoldenSet(name, run_markers=("<image>",)) for name in ("minicpmv2_0", "minicpmv2_5")}


def golden_rows(codes: np.ndarray, h: int, w: int) -> np.ndarray:
    """The READMEs' pixel encoding as our rows: [P, 3 * 14 * 14], patch k's pixels in (channel,
    dy, dx) order, from [3, 14, 14 * P] codes in `reshape_by_patch` layout or (2.0's) the slice's
    plain [3, 14 * h, 14 * w]."""
    pixels = ((codes.astype(np.float32) / 255) - 0.5) / 0.5
    if codes.shape == (3, 14 * h, 14 * w):
        return pixels.reshape(3, h, 14, w, 14).transpose(1, 3, 0, 2, 4).reshape(h * w, -1)
    return pixels.reshape(3, 14, h * w, 14).transpose(2, 0, 1, 3).reshape(h * w, -1)


def official_image_bound(ids: np.ndarray, golden: GoldenSet) -> np.ndarray:
    """`MiniCPMVProcessor._convert`: [start, end) of each run after one of the set's `run_markers`
    (`<image>` / `<slice>`), ending at the next closing one (`</image>` / `</slice>`)."""
    starts = np.flatnonzero(np.isin(ids, [golden.special_id(m) for m in golden.run_markers])) + 1
    ends = np.flatnonzero(np.isin(ids, [golden.special_id(m.replace("<", "</")) for m in golden.run_markers]))
    return np.stack([starts, ends], axis=1).reshape(-1, 2)


def engine_tokens(checkpoint: Path, input_ids: np.ndarray, rows: np.ndarray, max_tokens: int) -> list[int]:
    """The llm's greedy tokens in process for a prompt of 1-D positions (the official `MiniCPMV`'s),
    its image rows at the `<unk>` runs."""
    from tests.test_llm import Collector
    from triton_vlm.llm import Engine, SamplingParams

    engine, collector, n = Engine(checkpoint), Collector(), len(input_ids)
    try:
        engine.submit("in-process", input_ids, rows, np.broadcast_to(np.arange(n), (3, n)).copy(),
                      np.zeros(1, np.int64), SamplingParams(max_tokens=max_tokens), collector)
        collector.wait()
    finally:
        engine.shutdown()
    return collector.ids


def close(rows, expected) -> None:
    rows, expected = np.asarray(rows), np.asarray(expected).reshape(np.shape(rows))
    assert np.abs(rows - expected).max(initial=0) <= ATOL, np.abs(rows - expected).max()


def pytest_generate_tests(metafunc) -> None:
    """A `GoldenChecks` test's cases from its class: `case` those it serves (`served_cases`),
    `image_case` those of images (or none), `media_case` those with images, `golden_case` all."""
    if getattr(metafunc.cls, "GOLDEN", None) is None:
        return
    golden = metafunc.cls.GOLDEN
    for name, cases in (("case", metafunc.cls.served_cases()), ("image_case", golden.image_cases),
                        ("media_case", golden.media_cases), ("golden_case", list(golden.cases))):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, cases)


class GoldenChecks:
    """One version's golden set through a real tritonserver built from its golden checkpoint
    (`served_checkpoint`), the media sent as a client sends them (`served`): `preprocess` gives the
    official ids, image bounds, `tgt_sizes` and pixels; `vision_encoder` (ONNX Runtime) and the
    torch encoder the official resampler rows; the ensemble the official greedy tokens, and
    log-probabilities the official logits'; the llm's greedy steps the official logits. `GOLDEN`
    names the set."""
    GOLDEN: GoldenSet

    @classmethod
    def served_checkpoint(cls, root: Path) -> Path:
        """The checkpoint the server is built from (a folder under `root` for one of its own)."""
        return cls.GOLDEN.root

    @classmethod
    def served(cls, case: str) -> tuple[str, list[bytes], list[bytes], dict | None]:
        """(prompt, images, videos, mm_options) of a case as a client sends it."""
        return (*cls.GOLDEN.request(case), None)

    @classmethod
    def served_cases(cls) -> list[str]:
        return cls.GOLDEN.image_cases

    @pytest.fixture(scope="class")
    @classmethod
    def server(cls, tmp_path_factory):
        from tests.servers import LEAN, running
        from triton_vlm.repository.build import build_repository
        from triton_vlm.server.tritonserver import TritonServer

        root = tmp_path_factory.mktemp(cls.GOLDEN.root.name)
        repo = build_repository(cls.served_checkpoint(root), root / "repository", LEAN)
        with running(TritonServer(repo, log_file=root / "tritonserver.log")) as server:
            yield server

    @pytest.fixture(scope="class")
    @classmethod
    def preprocessed(cls, server):
        """Every case through the served `preprocess`."""
        from tests.test_e2e import infer_direct, media_values

        outputs = ["input_ids", "pixel_values", "grid_thw", "mrope_position_ids", "mrope_position_delta",
                   "padded_patches"]
        return {case: infer_direct(server, "preprocess", media_values(*cls.served(case)), outputs)
                for case in cls.GOLDEN.image_cases}

    def test_preprocess_gives_the_official_ids_bounds_and_pixels(self, preprocessed, image_case):
        """`input_ids` equal; the `<unk>` runs the decoder fills are the official `image_bound`
        (also read off our ids as the official processor reads them); `tgt_sizes` equal; every
        slice's pixels the official ones, bit for bit; positions 0..S-1 (the official model gives
        its language model none)."""
        case, golden, values, out = image_case, self.GOLDEN, self.GOLDEN.values, preprocessed[image_case]
        ids = out["input_ids"].reshape(-1)
        np.testing.assert_array_equal(ids, values[f"{case}/input_ids"])
        bound = values[f"{case}/image_bound"].reshape(-1, 2)
        np.testing.assert_array_equal(official_image_bound(ids, golden), bound)
        runs = np.concatenate([np.arange(a, b) for a, b in bound] + [np.zeros(0, int)])
        np.testing.assert_array_equal(np.flatnonzero(ids == golden.special_id("<unk>")), runs)
        grid = out["grid_thw"].reshape(-1, 3)
        np.testing.assert_array_equal(grid, np.c_[np.ones(len(grid), int), values[f"{case}/tgt_sizes"].reshape(-1, 2)])
        starts = np.r_[0, np.cumsum(grid.prod(axis=1))]
        for i, (_, h, w) in enumerate(grid.tolist()):
            np.testing.assert_array_equal(out["pixel_values"][starts[i]:starts[i + 1]],
                                          golden_rows(values[f"{case}/pixel_codes/{i}"], h, w), err_msg=str(i))
        assert starts[-1] == len(out["pixel_values"])
        np.testing.assert_array_equal(out["mrope_position_ids"], np.broadcast_to(np.arange(len(ids)), (3, len(ids))))
        assert int(np.ravel(out["mrope_position_delta"])[0]) == 0
        padded = np.ravel(out["padded_patches"])
        if "padded_patches" in self.tower_class().EXTRAS:  # 2.5's: every slice padded to the largest
            np.testing.assert_array_equal(padded, np.full(len(grid), grid.prod(axis=1).max(initial=0)))
        else:
            assert not padded.any()

    @classmethod
    def tower_class(cls) -> type:
        from triton_vlm.families import detect_family

        return detect_family(cls.GOLDEN.root).tower_class()

    @pytest.fixture(scope="class")
    @classmethod
    def tower(cls):
        """(its `Tower` class, the torch tower with the golden weights, its settings)."""
        tower_class = cls.tower_class()
        return (tower_class, tower_class.load_tower(cls.GOLDEN.root).eval(),
                tower_class.read_vision_config(cls.GOLDEN.root))

    def test_the_encoders_give_the_official_rows(self, server, preprocessed, tower, media_case):
        """The served `vision_encoder` (the ONNX export in ONNX Runtime) and the torch encoder on
        the served pixels and extras: the resampler rows; the torch tower's `vpm` hidden state of
        every slice the set holds one of (`vpm_hidden/I`), and every slice's NaViT position ids
        (the first h * w of a padded slice's)."""
        from tests.test_e2e import infer_direct
        from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

        case, values, out = media_case, self.GOLDEN.values, preprocessed[media_case]
        pixels, grid, padded = np.array(out["pixel_values"]), out["grid_thw"], np.ravel(out["padded_patches"])
        inputs = {"pixel_values": (pixels, "FP32"), "grid_thw": (grid, "INT64"), "padded_patches": (padded, "INT64")}
        rows = infer_direct(server, "vision_encoder", inputs, ["embeddings"])["embeddings"]
        close(rows, values[f"{case}/vision_embeds"])
        tower_class, tower, settings = tower
        extras = {"padded_patches": padded} if "padded_patches" in tower_class.EXTRAS else {}
        close(TorchEncoder(self.GOLDEN.root).encode(pixels, grid, extras), values[f"{case}/vision_embeds"])
        metadata = tower_class.metadata(grid, settings, extras)
        with torch.inference_mode():
            hidden = tower.hidden(torch.from_numpy(pixels), *(torch.from_numpy(metadata[k])
                                                              for k in type(tower).HIDDEN_INPUTS)).numpy()
        checked = 0
        for i, slice_hidden in enumerate(np.split(hidden, np.cumsum(grid.prod(axis=1))[:-1])):
            if f"{case}/vpm_hidden/{i}" in values:
                close(slice_hidden, values[f"{case}/vpm_hidden/{i}"])
                checked += 1
        assert checked == sum(key.startswith(f"{case}/vpm_hidden/") for key in values)  # every one the set holds
        if f"{case}/vision_position_ids/0" not in values:  # (2.0's timm tower has none)
            return
        frames = (metadata["full_mask"] == 0).sum(axis=1)  # each slice's attended rows, padding included
        for i, ids in enumerate(np.split(metadata["position_ids"], np.cumsum(frames)[:-1])):
            expected = values[f"{case}/vision_position_ids/{i}"]
            np.testing.assert_array_equal(ids[:len(expected)], expected, err_msg=str(i))
            assert len(expected) == grid[i, 1] * grid[i, 2]

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls):
        from triton_vlm.llm import Engine

        engine = Engine(cls.GOLDEN.root, return_logits=True, kv_cache_tokens=4096)
        yield engine
        engine.shutdown()

    def test_greedy_logits_equal_the_official_step_by_step(self, engine, golden_case):
        """The llm on the golden ids with the golden rows at the `<unk>` runs: its greedy steps (a
        prefill, then decode steps over the paged KV cache) give the official `generate`'s tokens,
        each step's logits (those after the golden tokens so far) within 1e-4 of the golden ones, and
        stops where it does (a terminator, or the 8 tokens)."""
        from tests.test_llm import Collector
        from triton_vlm.llm import SamplingParams

        case, values = golden_case, self.GOLDEN.values
        ids, rows = values[f"{case}/input_ids"].astype(np.int32), values[f"{case}/vision_embeds"]
        n, collector = len(ids), Collector()
        engine.submit(case, ids, rows.reshape(-1, rows.shape[-1]).astype(np.float32),
                      np.broadcast_to(np.arange(n), (3, n)).copy(), np.zeros(1, np.int64),
                      SamplingParams(max_tokens=8), collector)
        collector.wait()
        expected = values[f"{case}/gen_tokens"].tolist()
        assert collector.ids == expected and len(collector.outputs) == len(expected)
        assert collector.finish_reason == ("stop" if expected[-1] in engine.eos_token_ids else "length")
        for out, reference in zip(collector.outputs, values[f"{case}/greedy_logits"]):
            close(out.logits, reference)

    def test_greedy_tokens_equal_the_official_generate(self, server, case):
        """The ensemble's tokens over gRPC streaming equal the official `generate`'s (which stops
        at its terminators), and over HTTP generate too, with log-probabilities the official
        logits' log-softmax."""
        from tests.test_e2e import grpc_tokens
        from triton_vlm.clients.client import generate_payload, http_generate

        prompt, images, videos, options = self.served(case)
        expected = self.GOLDEN.values[f"{case}/gen_tokens"].tolist()
        assert grpc_tokens(server, prompt, images, videos, max_tokens=8, mm_options=options) == expected
        (answer,) = http_generate(server.http_url, generate_payload(prompt, images, videos, options, max_tokens=8,
                                                                    return_log_probs=True))
        assert [int(i) for i in np.atleast_1d(answer["output_ids"])] == expected
        logits = self.GOLDEN.values[f"{case}/greedy_logits"][:len(expected)].astype(np.float64)
        log_softmax = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
            - logits.max(1, keepdims=True)
        close(np.ravel(answer["output_log_probs"]), log_softmax[np.arange(len(expected)), expected])

    def test_infer_renders_the_checkpoints_chat_template(self, server):
        """`triton-vlm infer --image FILE --prompt TEXT`: the question through the chat template the
        server took from the checkpoint, as the official `chat()` writes it, answers as the
        official `generate` does."""
        import subprocess
        import sys

        case = next(c for c in self.GOLDEN.media_cases if len(self.GOLDEN.cases[c]["media"]) == 1)
        c = self.GOLDEN.cases[case]
        content = c["chat"]["msgs"][0]["content"]  # (2.0's chat takes its image beside the messages)
        (question,) = [content] if isinstance(content, str) else [part for part in content if isinstance(part, str)]
        done = subprocess.run([sys.executable, "-m", "triton_vlm.tools.cli", "infer", "--url", server.grpc_url,
                               "--image", str(self.GOLDEN.root / c["media"][0]["file"]), "--prompt", question,
                               "--max-tokens", "8", "--json"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["output_ids"] == self.GOLDEN.values[f"{case}/gen_tokens"].tolist()

    def test_concurrent_requests_each_get_the_official_answer(self, server):
        from tests.test_e2e import concurrently, grpc_tokens

        def answer(case: str) -> list[int]:
            prompt, images, videos, options = self.served(case)
            return grpc_tokens(server, prompt, images, videos, max_tokens=8, mm_options=options)

        cases = self.served_cases()
        answers = concurrently(answer, cases)
        assert answers == {case: self.GOLDEN.values[f"{case}/gen_tokens"].tolist() for case in cases}
