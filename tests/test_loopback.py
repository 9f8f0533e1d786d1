"""`triton_vlm.loopback`'s error codes, without a server: a gRPC call's status, a streamed error's
`[CODE] ` prefix (the llm's, when the ensemble asks), refusals for now as UNAVAILABLE. The stream
itself runs in every test that goes through the ensemble."""
from __future__ import annotations

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from triton_vlm.loopback import failure_of, with_code
from triton_vlm.pipeline import Failure


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
    from triton_vlm.loopback import URL_ENV, GrpcSteps
    from triton_vlm.server import free_port

    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    replies = list(GrpcSteps(url).stream("llm", {"input_ids": np.array([[1, 2]], dtype=np.int32)}, ["output_ids"], "r"))
    assert len(replies) == 1 and isinstance(replies[0], Failure)
    assert replies[0].code == "UNAVAILABLE" and url in replies[0].message and URL_ENV in replies[0].message
