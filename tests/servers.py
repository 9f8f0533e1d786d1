"""A real tritonserver over a repository built for one test module."""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def served(checkpoint, tmp_path_factory, name: str, options, **server_kwargs) -> Iterator:
    """`checkpoint` built with BuildOptions `options` into a fresh folder named after `name`, and
    served on free ports until the `with` ends."""
    from triton_vlm.repository.build import build_repository
    from triton_vlm.server.tritonserver import TritonServer

    repo = build_repository(checkpoint, tmp_path_factory.mktemp(name) / "repository", options)
    with TritonServer(repo, **server_kwargs) as running:
        yield running
