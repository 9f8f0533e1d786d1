"""Triton's admin APIs, closed to clients without the admin key.

tritonserver answers every client on every API unless told otherwise: any client could list, map
and unregister shared memory, load and unload models, turn tracing on or change logging.
`triton-vlm serve` (`triton_vlm.server.tritonserver.TritonServer`) restricts those APIs to requests that carry
the key in the header `ADMIN_HEADER` (HTTP) or `GRPC_ADMIN_HEADER` (gRPC metadata): the
operator's (`--admin-key`, or `TRITON_VLM_ADMIN_KEY`) or, without one, a random key made for
that start that only the server's own supervisor holds. Inference, health, metadata, model config and statistics stay open, as
Triton's users expect. The key reaches tritonserver on its command line (Triton takes it no other
way) and is never printed.
"""
from __future__ import annotations

import re
import secrets

ADMIN_HEADER = "triton-vlm-admin-key"
# tritonserver reads a restricted gRPC protocol's key from metadata of this name (its prefix added).
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER
ADMIN_KEY_ENV = "TRITON_VLM_ADMIN_KEY"
RESTRICTED = ("shared-memory", "model-repository", "trace", "logging")
# Triton splits the flag's value at ",", ":" and "="; a header value may not hold spaces either.
_KEY = re.compile(r"[A-Za-z0-9._~+/-]{16,256}")


def new_key() -> str:
    """A random key (256 bits) for one start of the server."""
    return secrets.token_urlsafe(32)


def check_key(key: str) -> str:
    """`key` if it can be the admin key; ValueError naming the rule (not the key) otherwise."""
    if not _KEY.fullmatch(key):
        raise ValueError("the admin key must be 16 to 256 characters of A-Z a-z 0-9 . _ ~ + / -")
    return key


def restricted_args(key: str) -> list[str]:
    """tritonserver's flags that close `RESTRICTED` to requests without `ADMIN_HEADER: key`."""
    apis = ",".join(RESTRICTED)
    return [f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={key}",
            f"--http-restricted-api={apis}:{ADMIN_HEADER}={key}"]


def headers(key: str, grpc: bool = False) -> dict[str, str]:
    """The header an admin request carries (over gRPC: its metadata, tritonclient's `headers`)."""
    return {GRPC_ADMIN_HEADER if grpc else ADMIN_HEADER: key}
