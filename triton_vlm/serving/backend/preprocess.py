"""`preprocess`: the contract's `PreprocessRequest` in, `Preprocessor`'s `PreprocessOutput` out."""
from __future__ import annotations

from typing import Any

from triton_vlm.contract.messages import PreprocessRequest
from triton_vlm.serving.backend import pb


class PreprocessModel:
    def initialize(self, args: dict[str, Any]) -> None:
        from triton_vlm.contract.limits import Limits
        from triton_vlm.contract.params import PreprocessOptions
        from triton_vlm.preprocessing.preprocessor import Preprocessor

        version_dir, params = pb.model_dir(args)
        self.preprocessor = Preprocessor(version_dir / params["checkpoint"], Limits.from_params(params),
                                         PreprocessOptions.from_params(params))
        self.preprocessor.warmup()

    def _handle(self, request) -> dict:
        r = PreprocessRequest.from_inputs(pb.getter(request))
        return self.preprocessor(r.text_input, r.images, r.videos, r.mm_options).to_tensors()

    def execute(self, requests):
        return pb.serve_each(requests, self._handle)
