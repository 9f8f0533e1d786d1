"""`ensemble`: `triton_vlm.serving.pipeline.Pipeline` over preprocess -> vision_encoder (unary BLS
calls, each output passed on as it is) -> llm, streamed over the server's own gRPC endpoint
(`triton_vlm.serving.loopback`: a streamed BLS call's responses are freed without the GIL in this
Triton, which crashed the stub under load).

A Triton ensemble would not tell a running decoupled step that its client cancelled or went away
(Triton 2.51); the pipeline sees it and this model sends the last step a `stop` request with the
same request id, so the llm ends the request within a step and frees its KV blocks. Its sampling
inputs are checked (`SamplingParams.from_inputs`) before any step runs.

Nor does Triton 2.51 end what a decoupled step held when its stub dies: this model watches the
server's stubs (`triton_vlm.server.stubs.StepWatch`) and ends the requests waiting on a step that
died, or on a model it calls, with UNAVAILABLE (`pipeline.restarted`) at once: a unary BLS call to
it would return only when the supervisor has reloaded it. Each death is counted in
`triton_vlm_step_restarts_total{model=...}`.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

from triton_vlm.contract.sampling import SamplingParams
from triton_vlm.contract.tensors import Step
from triton_vlm.server.stubs import StepWatch, model_of
from triton_vlm.serving.backend import pb
from triton_vlm.serving.loopback import GrpcSteps, server_url
from triton_vlm.serving.pipeline import Failure, Pipeline, Reply, StepFailed, restarted


class PipelineModel:
    def initialize(self, args: dict[str, Any]) -> None:
        _, params = pb.model_dir(args)
        steps = [Step.from_json(step) for step in json.loads(params["steps"])]
        self.final_output = params["final_output"]
        self.steps = GrpcSteps(server_url(), refusal=self._refusal)
        self.pipeline = Pipeline(steps, call=self._call, stream=self._stream, stop=self._stop,
                                 check=SamplingParams.from_inputs, is_empty=lambda tensor: pb.array(tensor).size == 0,
                                 max_inflight=int(params["max_inflight_requests"]))
        self._labels = {"version": args["model_version"]}
        self._families = [pb.metric_family(
            "triton_vlm_step_restarts_total", "stub deaths of each model the ensemble calls (directly or not), as "
            "the ensemble saw them; triton-vlm serve reloads the model", "counter")]
        self._restarts: dict[str, Any] = {}
        self.watch = StepWatch(os.getppid(), {args["model_name"]}, self._step_died, self._ready)

    def _ready(self, model: str) -> bool:
        """Whether the server says `model` is ready (its health API)."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        try:
            with grpcclient.InferenceServerClient(self.steps.url) as client:
                return client.is_model_ready(model, client_timeout=2.0)
        except InferenceServerException:
            return False

    def _step_died(self, instance: str, pid: int) -> None:
        """A stub of a model died: count it; requests waiting on it end now (a unary call would
        return only once the model is reloaded), and its streams are closed."""
        model = model_of(instance)
        if model not in self._restarts:
            self._restarts[model] = self._families[0].Metric(labels={**self._labels, "model": model})
        self._restarts[model].increment(1)
        self.pipeline.abort(model, restarted(model))
        self.steps.abort(model, restarted(model))

    def execute(self, requests):
        for request in requests:
            # Copies: the request's own memory is not ours once execute returns.
            inputs = {t.name(): t.as_numpy().copy() for t in request.inputs()}
            client = _Client(pb.Sender(request), frozenset(request.requested_output_names()))
            self.pipeline.submit(inputs, client, request.request_id() or "ensemble")
        return None

    def _refusal(self, model: str) -> Failure | None:
        """A request for `model` while a stub of it is dead and it is not reloaded yet."""
        return restarted(model) if self.watch.down(model) else None

    def _call(self, step: Step, tensors: dict, request_id: str) -> dict:
        refused = self._refusal(step.model)
        if refused is not None:
            raise StepFailed(refused)
        return pb.bls_call(step.model, tensors, step.outputs, request_id)

    def _stream(self, step: Step, tensors: dict, request_id: str) -> Iterator[Reply]:
        """The last step's responses, as the client's (`self.steps` refuses a step that is down).
        A response that ends a sequence (its `final_output` set) is held until the next one comes
        or the step's stream ends: the last of them is the request's final response (a request
        with several sequences ends each one)."""
        arrays = {name: pb.array(tensor) for name, tensor in tensors.items()}
        ending = None
        for reply in self.steps.stream(step.model, arrays, step.outputs, request_id):
            if ending is not None:
                yield Reply(outputs=pb.tensors(ending))
                ending = None
            if isinstance(reply, Failure):
                yield Reply(error=reply)
                continue
            reason = reply.get(self.final_output)
            if reason is not None and any(bytes(r) for r in reason.reshape(-1)):
                ending = reply
            else:
                yield Reply(outputs=pb.tensors(reply))
        if ending is not None:
            yield Reply(outputs=pb.tensors(ending), final=True)

    def _stop(self, request_id: str) -> None:
        pb.send_stop(self.pipeline.steps[-1].model, request_id)

    def finalize(self) -> None:
        self.watch.close()
        self.pipeline.close()
        pb.release_metrics(self._restarts, self._families)


class _Client:
    """`pipeline.Client` over a decoupled model's response sender. A response holds only the
    outputs the client asked for (`requested`; empty: all), so that the stub never drops one
    without the GIL (`ResponseBuilder`'s note)."""

    def __init__(self, sender: pb.Sender, requested: frozenset[str]) -> None:
        self.sender, self.requested = sender, requested

    def send(self, outputs: list, final: bool) -> None:
        if self.requested:
            outputs = [tensor for tensor in outputs if tensor.name() in self.requested]
        self.sender.send(outputs, final)

    def close(self, error: Failure | None = None) -> None:
        self.sender.finish(error)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()
