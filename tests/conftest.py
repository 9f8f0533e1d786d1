"""Session fixtures shared by the test files: the tiny checkpoint, the HF oracle, one running server."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from tests import oracle  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from triton_vlm.families.demo import write_demo_checkpoint

    return write_demo_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl-tiny"), "tiny")


@pytest.fixture(scope="session")
def hf(tiny_checkpoint) -> oracle.Oracle:
    return oracle.Oracle(tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_repo(tiny_checkpoint, tmp_path_factory):
    """The session repository. Its preprocess limits are the defaults but for bytes and source
    frames, which are small enough for tests/test_bad_inputs.py to breach over the wire with
    small payloads; no other test's media come near them."""
    from triton_vlm.contract.limits import Limits
    from triton_vlm.repository.build import build_repository
    from triton_vlm.repository.options import BuildOptions

    limits = Limits(max_item_bytes=1 << 20, max_request_bytes=2 << 20, max_video_source_frames=500)
    return build_repository(tiny_checkpoint, tmp_path_factory.mktemp("repo") / "repository", BuildOptions(limits=limits))


@pytest.fixture(scope="session")
def lean_repo(tiny_checkpoint, tmp_path_factory):
    """The session build with one instance per step (tests/servers.LEAN): for the tests that start
    a server of their own and check what happens to it, not how requests spread over instances."""
    from tests.servers import LEAN
    from triton_vlm.repository.build import build_repository

    return build_repository(tiny_checkpoint, tmp_path_factory.mktemp("lean") / "repository", LEAN)


@pytest.fixture(scope="session")
def server(tiny_repo, tmp_path_factory):
    """One real tritonserver for the whole session, on free ports; always stopped."""
    from tests.servers import running
    from triton_vlm.server.tritonserver import TritonServer

    with running(TritonServer(tiny_repo, log_file=tmp_path_factory.mktemp("logs") / "tritonserver.log")) as server:
        yield server


# Preprocess fixtures shared by the tests/test_preprocess*.py files.
@pytest.fixture(scope="session")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="session")
def pre(ckpt):
    from triton_vlm.preprocessing.preprocessor import Preprocessor

    return Preprocessor(ckpt)


@pytest.fixture(scope="session")
def hf_processor(hf):
    processor = hf.processor
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"  # torchvision backend
    assert type(processor.video_processor).__name__ == "Qwen2VLVideoProcessor"
    return processor


@pytest.fixture(scope="session")
def hf_model(hf):
    return hf.model


@pytest.fixture(scope="session")
def ckpt_config(ckpt):
    import json

    return json.loads((ckpt / "config.json").read_text())


# Vision encoder fixtures shared by the per-family tests/test_vision_encoder_*.py files; a module
# that uses them defines `repo`, a repository build of its checkpoint.
@pytest.fixture(scope="module")
def onnx_path(repo):
    """The float32 encoder the build wrote."""
    return repo / "vision_encoder" / "1" / "encoder.onnx"


@pytest.fixture(scope="module")
def encoder(onnx_path):
    """The build's encoder through the runtime that serves it."""
    from triton_vlm.vision.runtime.encoder import VisionEncoder

    return VisionEncoder(onnx_path)


@pytest.fixture(scope="session")
def golden():
    """The official MiniCPM-V 4.5 golden values by key (`tests/minicpmv4_5_golden.py`)."""
    from tests.minicpmv4_5_golden import golden_values

    return golden_values()
