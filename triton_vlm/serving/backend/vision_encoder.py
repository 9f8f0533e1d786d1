"""`vision_encoder` (max_batch_size 0; any number of items, zero included): a light front
(`triton_vlm.vision.front.EncoderFront`) over the internal `vision_encoder_batch`, reached through
BLS, where Triton's dynamic batcher puts the rows of several requests into one execution. Several
front instances run so that concurrent requests reach the batcher together; they hold no weights.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from triton_vlm.contract.messages import EncoderBatchRequest, EncoderRequest
from triton_vlm.contract.params import EncoderOptions
from triton_vlm.errors import InvalidInput
from triton_vlm.serving.backend import pb
from triton_vlm.serving.pipeline import StepFailed, gone, restarted
from triton_vlm.vision.front import EncoderFront


class VisionEncoderModel:
    def initialize(self, args: dict[str, Any]) -> None:
        _, params = pb.model_dir(args)
        self.front = EncoderFront(EncoderOptions.from_params(params), self._send)

    def _send(self, request: EncoderBatchRequest) -> np.ndarray:
        """One share's rows through the batched model; its errors as this request's."""
        batch_model = self.front.options.batch_model
        try:
            return pb.bls_call(batch_model, request.to_tensors(), ["embeddings"])["embeddings"].as_numpy()
        except StepFailed as failed:
            error = gone(batch_model, failed.error)
            if error.code == "INVALID_ARG":
                raise InvalidInput(error.message) from None
            if error.code == "UNAVAILABLE":
                raise pb.Unavailable(error.message if error == restarted(batch_model)
                                     else f"{batch_model}: {error.message}") from None
            raise RuntimeError(f"{batch_model}: {error.message}") from None

    def _handle(self, request) -> dict:
        return self.front.encode(EncoderRequest.from_inputs(pb.getter(request))).to_tensors()

    def execute(self, requests):
        return pb.serve_each(requests, self._handle)
