"""A real tritonserver over a repository built for one test module."""
from __future__ import annotations

import contextlib
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
