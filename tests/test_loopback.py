"""`triton_vlm.serving.loopback`'s error codes, without a server: a gRPC call's status, a streamed error's
`[CODE] ` prefix (the llm's, when the ensemble asks), refusals for now as UNAVAILABLE. The stream
itself runs in every test that goes through the ensemble."""
from __future__ import annotations

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from triton_vlm.serving.loopback import failure_of, with_code
from triton_vlm.serving.pipeline import Failure


@pytest.mark.parametrize("status, code", [("StatusCode.INVALID_ARGUMENT", "INVALID_ARG"),
                                          ("StatusCode.UNAVAILABLE", "UNAVAILABLE"),
                                          ("StatusCode.INTERNAL", "INTERNAL"), (None, "INTERNAL")])
def test_unary_error_keeps_its_status(status, code):
    assert failure_of(InferenceServerException("images[0]: not an image", status=status)) == Failure(
        code, "images[0]: not an image")


def test_streamed_error_reads_the_code_the_llm_wrote():
    message = with_code("INVALID_ARG", "prompt is 5000 tokens, context is 4096")
    assert failure_of(InferenceServerException(message)) == Failure("INVALID_ARG", "prompt is 5000 tokens, context is 4096")
    # Triton may put the request id before it
    tagged = "[request id: r-1] " + with_code("UNAVAILABLE", "queue timeout")
    assert failure_of(InferenceServerException(tagged)) == Failure("UNAVAILABLE", "[request id: r-1] queue timeout")


def test_untagged_refusal_for_now_is_unavailable():
    assert failure_of(InferenceServerException("Exceeds maximum queue size")).code == "UNAVAILABLE"
    assert failure_of(InferenceServerException("something broke")).code == "INTERNAL"


def test_unreachable_endpoint_is_named_in_the_error():
    from triton_vlm.contract.params import URL_ENV
    from triton_vlm.server.tritonserver import free_port
    from triton_vlm.serving.loopback import GrpcSteps

    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    replies = list(GrpcSteps(url).stream("llm", {"input_ids": np.array([[1, 2]], dtype=np.int32)}, ["output_ids"], "r"))
    assert len(replies) == 1 and isinstance(replies[0], Failure)
    assert replies[0].code == "UNAVAILABLE" and url in replies[0].message and URL_ENV in replies[0].message


def test_a_step_that_died_is_refused_or_aborted_never_waited_for():
    """`refusal` is asked once the request's stream is registered: a step that died before is
    refused without a call, and a death seen at that very moment (its `abort` comes before the
    stream starts) still ends the request, instead of its waiting for an answer that never comes."""
    from triton_vlm.server.tritonserver import free_port
    from triton_vlm.serving.loopback import GrpcSteps

    dead = Failure("UNAVAILABLE", "the llm step restarted; retry")
    url = f"127.0.0.1:{free_port()}"  # nothing listens there: a call would fail otherwise
    tensors = {"input_ids": np.array([[1, 2]], dtype=np.int32)}
    refused = GrpcSteps(url, refusal=lambda model: dead)
    assert list(refused.stream("llm", tensors, ["output_ids"], "r")) == [dead]

    steps = GrpcSteps(url, refusal=lambda model: steps.abort(model, dead))
    assert list(steps.stream("llm", tensors, ["output_ids"], "r")) == [dead]
    # the stream serves the next request with nothing of that one
    steps.refusal = lambda model: None
    replies = list(steps.stream("llm", tensors, ["output_ids"], "r2"))
    assert len(replies) == 1 and replies[0] != dead and url in replies[0].message
