"""A real tritonserver over a repository built for one test module, and `triton-vlm openai` in front
of one."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from triton_vlm.repository.options import BuildOptions

# The instance counts of a server whose tests check answers, not how requests spread over
# instances: each instance costs about a second at every stop (python_backend r24.10 unloads a
# model's instances one after another, each after a one-second health check) and a `preprocess`
# instance about 3 s of CPU at every start (torch, torchvision and its warm-up).
LEAN = BuildOptions(preprocess_instances=1, encoder_frontends=1)


@contextlib.contextmanager
def running(server) -> Iterator:
    """`server` (a `TritonServer`) started, and killed with its stubs when the `with` ends (its
    reaper removes what they leave): a graceful shutdown costs about a second per model instance
    and is no part of what a test's server is for; tests/test_cli.py checks that one."""
    try:
        yield server.start()
    finally:
        server.stop(kill=True)


@contextlib.contextmanager
def served(checkpoint, tmp_path_factory, name: str, options, **server_kwargs) -> Iterator:
    """`checkpoint` built with BuildOptions `options` into a fresh folder named after `name`, and
    served on free ports until the `with` ends."""
    from triton_vlm.repository.build import build_repository
    from triton_vlm.server.tritonserver import TritonServer

    repo = build_repository(checkpoint, tmp_path_factory.mktemp(name) / "repository", options)
    with running(TritonServer(repo, **server_kwargs)) as server:
        yield server


@contextlib.contextmanager
def openai_api(grpc_url: str, checkpoint: Path, log: Path, model: str) -> Iterator:
    """`triton-vlm openai` against the ensemble at `grpc_url` (its chat template and tokenizer from
    `checkpoint`), on a free port, as the official `openai` client reaches it; always stopped."""
    import openai

    from triton_vlm.server import reaper
    from triton_vlm.server.tritonserver import free_port

    port = free_port()
    command = [sys.executable, "-m", "triton_vlm.tools.cli", "openai", "--url", grpc_url, "--checkpoint",
               str(checkpoint), "--port", str(port), "--model-name", model]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        watcher = reaper.start(process, 5.0)  # (ended with this process too, if a killed test run never ends it)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, "triton-vlm openai exited"
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "triton-vlm openai not up"
                    time.sleep(0.2)
            yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        finally:
            process.terminate()
            process.wait(timeout=30)
            watcher.wait(timeout=30)
