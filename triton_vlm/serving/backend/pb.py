"""Triton's Python-backend utilities as the adapters use them: the only module that imports
`triton_python_backend_utils`.

Tensors in (`getter`) and out (`tensors`), responses and errors (`response`, `error_response`,
`serve_each`), unary BLS calls (`bls_call`) and the llm's `stop` request (`send_stop`), a decoupled
sender (`Sender`), custom metrics (`metric_family`, `release_metrics`). Importing it starts this
stub's watcher (`triton_vlm.server.stub_watch`: a stub must not outlive its server) and lets a hung
stub be asked for its threads' stacks (SIGUSR1, `triton_vlm.server.stubs.dump_stacks`).
"""
from __future__ import annotations

import faulthandler
import json
import signal
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import triton_python_backend_utils as pb_utils

from triton_vlm.errors import InvalidInput
from triton_vlm.server import stub_watch
from triton_vlm.serving.pipeline import Failure, StepFailed, step_failure

# Every stub that imports this module, the one that only reads a model's config included, is ended
# with its server, and skips its interpreter's teardown at its own end (`triton_vlm.server.stub_watch`).
stub_watch.start()
stub_watch.exit_without_teardown()
faulthandler.register(signal.SIGUSR1, all_threads=True)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_CODES = ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS",
          "CANCELLED")


class Unavailable(Exception):
    """A model this one calls refused the request for now (its queue was full or timed out):
    answered UNAVAILABLE, as that model did, so the client knows it may retry."""


def model_dir(args: dict[str, Any]) -> tuple[Path, dict[str, str]]:
    """A model's version folder and its config parameters, from its `initialize` arguments."""
    config = json.loads(args["model_config"])
    params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
    return Path(args["model_repository"]) / args["model_version"], params


def getter(request) -> Callable[[str], np.ndarray | None]:
    """A request's inputs by name (an array, or None when absent): what the messages read."""
    def get(name: str) -> np.ndarray | None:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()
    return get


def tensors(arrays: Mapping[str, Any]) -> list:
    """Response (or BLS) tensors of `arrays` by name; a BLS output passes on as it is (in its shared
    memory, not copied)."""
    return [a if isinstance(a, pb_utils.Tensor) else pb_utils.Tensor(name, a) for name, a in arrays.items()]


def array(tensor) -> np.ndarray:
    """A pb_utils.Tensor's array (a view of its memory), or the array itself."""
    return tensor.as_numpy() if isinstance(tensor, pb_utils.Tensor) else tensor


def response(arrays: Mapping[str, Any] | list):
    return pb_utils.InferenceResponse(output_tensors=arrays if isinstance(arrays, list) else tensors(arrays))


def error_response(message: str, code: str = "INVALID_ARG"):
    """A response that fails its request alone (the stub sets `pb_utils.TritonError` up after this
    module is imported)."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code)))


def serve_each(requests, handle: Callable[[Any], Mapping[str, np.ndarray]]) -> list:
    """One response per request: `handle(request)`'s outputs, or INVALID_ARG / UNAVAILABLE for this
    request alone."""
    responses = []
    for request in requests:
        try:
            responses.append(response(handle(request)))
        except InvalidInput as error:
            responses.append(error_response(str(error)))
        except Unavailable as error:
            responses.append(error_response(str(error), "UNAVAILABLE"))
    return responses


def bls_call(model: str, inputs: Mapping[str, Any], outputs, request_id: str = "") -> dict:
    """One unary BLS call with `inputs` (arrays, or an earlier step's pb_utils.Tensor): `model`'s
    `outputs` present in its response, as pb_utils.Tensor; StepFailed on its error.
    python_backend r24.10 builds and frees a unary response's arrays under the GIL (README, "Why
    BLS")."""
    request = pb_utils.InferenceRequest(model_name=model, request_id=request_id, requested_output_names=list(outputs),
                                        inputs=tensors(inputs))
    result = request.exec()
    if result.has_error():
        error = result.error()
        names = {getattr(pb_utils.TritonError, name): name for name in _CODES}
        raise StepFailed(step_failure(names.get(error.code(), "INTERNAL"), error.message()))
    return {name: tensor for name in outputs
            if (tensor := pb_utils.get_output_tensor_by_name(result, name)) is not None}


def send_stop(model: str, request_id: str) -> None:
    """tensorrtllm_backend's `stop` request to `model`, over BLS (its one response has no tensors)."""
    stop = pb_utils.Tensor("stop", np.array([True]))
    request = pb_utils.InferenceRequest(model_name=model, request_id=request_id, inputs=[stop],
                                        requested_output_names=[])
    for _ in request.exec(decoupled=True):
        pass


class Sender:
    """A decoupled request's response sender: responses with tensors, the FINAL flag, errors."""

    def __init__(self, request) -> None:
        self.sender = request.get_response_sender()

    def send(self, outputs: Mapping[str, Any] | list, final: bool = False) -> None:
        self.sender.send(response(outputs), flags=FINAL if final else 0)

    def finish(self, error: Failure | None = None) -> None:
        """The last response: the error, or the FINAL flag alone."""
        if error is None:
            self.sender.send(flags=FINAL)
        else:
            self.sender.send(error_response(error.message, error.code), flags=FINAL)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


def metric_family(name: str, description: str, kind: str):
    """A custom metric family, `kind` "counter" or "gauge"."""
    return pb_utils.MetricFamily(name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind.upper()))


def release_metrics(*holders: dict | list) -> None:
    """Drop a model's metrics and metric families in `finalize`, while the stub can still tell the
    server: left to the stub's own teardown, each family's destructor clears its metrics through
    shared memory that is already gone (a segfault of the stub at every server stop, python_backend
    24.10)."""
    for holder in holders:
        holder.clear()
