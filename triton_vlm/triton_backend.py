"""The Triton Python-backend side of the models: the only module importing `triton_python_backend_utils`.

Each `model_repository/*/1/model.py` names one class here. A class turns request tensors into
one call into the package and the result back into tensors; `InvalidInput` becomes Triton's
INVALID_ARG with the message as is, so a bad request fails alone.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import triton_python_backend_utils as pb_utils

from triton_vlm import stub_watch
from triton_vlm.errors import InvalidInput
from triton_vlm.loopback import ERROR_CODES, GrpcSteps, server_url, with_code
from triton_vlm.options import EncoderBatchOptions, EncoderOptions, LLMOptions, instance_device
from triton_vlm.pipeline import Failure, Pipeline, Reply, Step, StepFailed, gone, restarted, step_failure
from triton_vlm.sampling_params import SamplingParams
from triton_vlm.stubs import StepWatch, model_of

log = logging.getLogger("triton_vlm")
# Every stub that imports this module, the one that only reads a model's config included, is ended
# with its server, and skips its interpreter's teardown at its own end (`triton_vlm.stub_watch`).
stub_watch.start()
stub_watch.exit_without_teardown()
# A stub that hangs can be asked where: its threads' stacks go to the server's output
# (`triton_vlm.stubs.dump_stacks`).
faulthandler.register(signal.SIGUSR1, all_threads=True)


def _model_dir(args: dict[str, Any]) -> tuple[Path, dict[str, str]]:
    config = json.loads(args["model_config"])
    params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
    return Path(args["model_repository"]) / args["model_version"], params


def _error_response(message: str, code: int | None = None) -> pb_utils.InferenceResponse:
    """A response that fails its request alone (INVALID_ARG unless told otherwise; the stub sets
    `pb_utils.TritonError` up after this module is imported)."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(
        message, pb_utils.TritonError.INVALID_ARG if code is None else code))


def _optional(request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _required(request, name: str) -> np.ndarray:
    value = _optional(request, name)
    if value is None:
        raise InvalidInput(f"{name}: required input is missing")
    return value


def _items(request, name: str) -> list[bytes]:
    value = _optional(request, name)
    return [] if value is None else [bytes(v) for v in value.reshape(-1)]


def _text(request, name: str) -> str | None:
    value = _optional(request, name)
    if value is None or value.size == 0:
        return None
    try:
        return bytes(value.reshape(-1)[0]).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"{name}: not valid UTF-8") from None


def _scalar(request, name: str, kind: Callable[[Any], Any]) -> Any:
    value = _optional(request, name)
    if value is None:
        return None
    if value.size != 1:
        raise InvalidInput(f"{name}: expected one value, got {value.size}")
    return kind(value.reshape(-1)[0])


_CODES = ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS",
          "CANCELLED")


def _bls_error(error) -> Failure:
    """The error of a BLS response, with the code to pass on (`pipeline.step_failure`)."""
    names = {getattr(pb_utils.TritonError, name): name for name in _CODES}
    return step_failure(names.get(error.code(), "INTERNAL"), error.message())


def _bls_call(model: str, tensors: dict, outputs, request_id: str = "") -> dict:
    """One unary BLS call with `tensors` (pb_utils.Tensor, or arrays: an earlier step's output goes
    on as it is, in its shared memory, not copied): `model`'s `outputs` present in its response, as
    pb_utils.Tensor; StepFailed on its error. python_backend r24.10 builds and frees a unary
    response's arrays under the GIL (README, "Why BLS")."""
    inputs = [t if isinstance(t, pb_utils.Tensor) else pb_utils.Tensor(name, t) for name, t in tensors.items()]
    request = pb_utils.InferenceRequest(model_name=model, request_id=request_id, requested_output_names=list(outputs),
                                        inputs=inputs)
    response = request.exec()
    if response.has_error():
        raise StepFailed(_bls_error(response.error()))
    return {name: tensor for name in outputs if (tensor := pb_utils.get_output_tensor_by_name(response, name)) is not None}


def _array(tensor) -> np.ndarray:
    """A pb_utils.Tensor's array (a view of its memory), or the array itself."""
    return tensor.as_numpy() if isinstance(tensor, pb_utils.Tensor) else tensor


def _failure_response(failure: Failure) -> pb_utils.InferenceResponse:
    return _error_response(failure.message, getattr(pb_utils.TritonError, failure.code))


class _Unavailable(Exception):
    """A model this one calls refused the request for now (its queue was full or timed out):
    answered UNAVAILABLE, as that model did, so the client knows it may retry."""


def _serve_each(requests, handle: Callable[[Any], list]) -> list:
    """One response per request: outputs, or INVALID_ARG / UNAVAILABLE for this request alone."""
    responses = []
    for request in requests:
        try:
            responses.append(pb_utils.InferenceResponse(output_tensors=handle(request)))
        except InvalidInput as error:
            responses.append(_error_response(str(error)))
        except _Unavailable as error:
            responses.append(_error_response(str(error), pb_utils.TritonError.UNAVAILABLE))
    return responses


class PreprocessModel:
    def initialize(self, args: dict[str, Any]) -> None:
        from triton_vlm.limits import Limits
        from triton_vlm.options import PreprocessOptions
        from triton_vlm.preprocess import Preprocessor

        version_dir, params = _model_dir(args)
        self.preprocessor = Preprocessor(version_dir / params["checkpoint"], Limits.from_params(params),
                                         PreprocessOptions.from_params(params))
        self.preprocessor.warmup()

    def _handle(self, request) -> list:
        text = _text(request, "text_input")
        if text is None:
            raise InvalidInput("text_input: required input is missing")
        out = self.preprocessor(text, _items(request, "images"), _items(request, "videos"), _text(request, "mm_options"))
        return [
            pb_utils.Tensor("input_ids", out.input_ids.astype(np.int32, copy=False)),
            pb_utils.Tensor("pixel_values", out.pixel_values.astype(np.float32, copy=False)),
            pb_utils.Tensor("grid_thw", out.grid_thw.astype(np.int64, copy=False)),
            pb_utils.Tensor("mrope_position_ids", out.mrope_position_ids.astype(np.int64, copy=False)),
            pb_utils.Tensor("mrope_position_delta", np.array([out.mrope_position_delta], dtype=np.int64)),
            pb_utils.Tensor("video_pruning_rate", np.array([out.video_pruning_rate], dtype=np.float64)),
            pb_utils.Tensor("media_position_ids", out.media_position_ids.astype(np.int64, copy=False)),
            pb_utils.Tensor("temporal_ids", out.temporal_ids.astype(np.int64, copy=False)),
            pb_utils.Tensor("image_sizes", out.image_sizes.astype(np.int64, copy=False)),
        ]

    def execute(self, requests):
        return _serve_each(requests, self._handle)


class VisionEncoderModel:
    """The contract's `vision_encoder` (max_batch_size 0; any number of items, zero included).

    A light front: it validates the request, answers zero items itself, and hands the patch rows
    to the internal `vision_encoder_batch` model through BLS, where Triton's dynamic batcher puts
    the rows of several requests into one execution (see `triton_vlm.vision.batching` for the
    row convention). Several front instances run so that concurrent requests reach the batcher
    together; they hold no weights.
    """

    def initialize(self, args: dict[str, Any]) -> None:
        _, params = _model_dir(args)
        self.options = EncoderOptions.from_params(params)
        # the anyres tower's settings, parsed once (not per request)
        self.anyres = json.loads(self.options.anyres_settings) if self.options.anyres_settings else None

    def _encode_rows(self, pixels: np.ndarray, grid: np.ndarray, rows_temporal: np.ndarray | None,
                     odd_share: bool, rows_sizes: np.ndarray | None = None) -> np.ndarray:
        from triton_vlm.repository import ODD_SHARE_INPUT, PATCH_IMAGE_SIZE_INPUT, PATCH_TEMPORAL_INPUT
        from triton_vlm.vision.batching import patch_grid

        batch_model = self.options.batch_model
        inputs = {"pixel_values": np.ascontiguousarray(pixels, dtype=np.float32), "patch_grid": patch_grid(grid)}
        if rows_temporal is not None:
            inputs[PATCH_TEMPORAL_INPUT] = rows_temporal.reshape(-1, 1)
        if rows_sizes is not None:
            inputs[PATCH_IMAGE_SIZE_INPUT] = np.ascontiguousarray(rows_sizes, dtype=np.int64)
        if odd_share:
            inputs[ODD_SHARE_INPUT] = np.ones((len(pixels), 1), dtype=bool)
        try:
            return _bls_call(batch_model, inputs, ["embeddings"])["embeddings"].as_numpy()
        except StepFailed as failed:
            error = gone(batch_model, failed.error)
            if error.code == "INVALID_ARG":
                raise InvalidInput(error.message) from None
            if error.code == "UNAVAILABLE":
                raise _Unavailable(error.message if error == restarted(batch_model)
                                   else f"{batch_model}: {error.message}") from None
            raise RuntimeError(f"{batch_model}: {error.message}") from None

    def _handle(self, request) -> list:
        from triton_vlm.evs import check_rate, prune
        from triton_vlm.vision import anyres
        from triton_vlm.vision.batching import embedding_rows, encode_in_shares, patch_image_sizes, patch_temporal_ids
        from triton_vlm.vision.encoder import validate_image_sizes, validate_inputs, validate_temporal_ids

        o = self.options
        pixels, items = validate_inputs(_required(request, "pixel_values"), _required(request, "grid_thw"),
                                        o.patch_dim, o.spatial_merge_size)
        temporal_ids = validate_temporal_ids(_optional(request, "temporal_ids"), items, o.packed_frames)
        image_sizes = validate_image_sizes(_optional(request, "image_sizes"), items, bool(o.anyres_settings))
        try:
            rate = check_rate(_scalar(request, "video_pruning_rate", float) or 0.0, "video_pruning_rate")
        except ValueError as error:
            raise InvalidInput(str(error)) from None
        if o.packed_frames:  # a packed group is one item, its frames resampled together
            grid, rows_temporal = items, patch_temporal_ids(items, temporal_ids)
        else:
            # A video's frames go as items of their own (triton_vlm.vision: frames are independent),
            # so a long video splits across batches and instances, and each frame is cached on its own.
            grid = np.repeat(np.concatenate([np.ones_like(items[:, :1]), items[:, 1:]], axis=1), items[:, 0], axis=0)
            rows_temporal = None
        if self.anyres is not None:  # (packed: the grid is the items)
            rows_per_item = anyres.embedding_rows(grid, self.anyres, image_sizes)
            rows_sizes = patch_image_sizes(grid, np.zeros((len(grid), 2), np.int64) if image_sizes is None else image_sizes)
        else:
            rows_per_item, rows_sizes = embedding_rows(grid, o.spatial_merge_size, o.query_num, o.extra_rows), None
        embeddings = encode_in_shares(pixels, grid, self._encode_rows, shares=o.batch_instances,
                                      max_rows=o.max_batch_patches, hidden=o.hidden, rows_per_item=rows_per_item,
                                      rows_temporal=rows_temporal, rows_sizes=rows_sizes)
        embeddings, kept = prune(embeddings, items, o.spatial_merge_size, rate)
        return [pb_utils.Tensor("embeddings", np.ascontiguousarray(embeddings, dtype=np.float32)),
                pb_utils.Tensor("kept_rows", kept)]

    def execute(self, requests):
        return _serve_each(requests, self._handle)


class VisionEncoderBatchModel:
    """`vision_encoder_batch`: the tower behind Triton's dynamic batcher (a back end of
    triton_vlm.vision.backends, on the instance's GPU or the CPU), with the embedding cache. One
    execution gets the requests Triton grouped; their distinct, uncached items are encoded together
    and split back per request. Cache hits and misses are Triton custom metrics
    (`triton_vlm_encoder_cache_hits` / `_misses`, items), with `triton_vlm_encoder_cache_bytes`
    (gauge) beside them, and `triton_vlm_encoder_patches` (patch rows received) per instance."""

    def initialize(self, args: dict[str, Any]) -> None:
        from triton_vlm.vision.backends import open_encoder
        from triton_vlm.vision.batching import BatchedEncoder, EmbeddingCache

        version_dir, params = _model_dir(args)
        options = EncoderBatchOptions.from_params(params)
        gpu = args.get("model_instance_kind") == "GPU"
        encoder = open_encoder(options, version_dir, instance_device(args, "cuda" if gpu else "cpu"))
        encoder.warmup()
        self.cache = EmbeddingCache(options.cache_bytes)
        self.batched = BatchedEncoder(encoder, self.cache)
        labels = {"model": args["model_name"], "version": args["model_version"]}
        # The families must stay referenced as long as their metrics are used.
        self._families = [
            pb_utils.MetricFamily(name="triton_vlm_encoder_cache_hits", description="media items served from the "
                                  "vision encoder cache (or repeated within one batch)", kind=pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily(name="triton_vlm_encoder_cache_misses", description="media items the vision "
                                  "encoder computed", kind=pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily(name="triton_vlm_encoder_cache_bytes", description="bytes of embeddings held "
                                  "in the vision encoder cache", kind=pb_utils.MetricFamily.GAUGE),
        ]
        self.hits, self.misses, self.cache_bytes = (family.Metric(labels=labels) for family in self._families)
        self._families.append(pb_utils.MetricFamily(
            name="triton_vlm_encoder_patches", description="patch rows this encoder instance received",
            kind=pb_utils.MetricFamily.COUNTER))
        self.patches = self._families[-1].Metric(labels={**labels, "instance": args["model_instance_name"]})

    def finalize(self) -> None:
        metrics = [self.hits, self.misses, self.cache_bytes, self.patches]
        del self.hits, self.misses, self.cache_bytes, self.patches
        _release_metrics(metrics, self._families)

    def execute(self, requests):
        from triton_vlm.repository import PATCH_IMAGE_SIZE_INPUT, PATCH_TEMPORAL_INPUT
        from triton_vlm.vision.batching import frames_from_rows, items_from_row_sizes, items_from_rows

        responses: list = [None] * len(requests)
        batch, where = [], []
        for i, request in enumerate(requests):
            try:
                pixels = _required(request, "pixel_values")
                grid = items_from_rows(pixels, _required(request, "patch_grid"))
                rows_temporal = _optional(request, PATCH_TEMPORAL_INPUT)
                temporal_ids = None if rows_temporal is None else frames_from_rows(rows_temporal, grid)
                rows_sizes = _optional(request, PATCH_IMAGE_SIZE_INPUT)
                sizes = () if rows_sizes is None else (items_from_row_sizes(rows_sizes, grid),)
                batch.append((np.asarray(pixels, dtype=np.float32), grid, temporal_ids, *sizes))
                where.append(i)
                self.patches.increment(len(pixels))
            except InvalidInput as error:
                responses[i] = _error_response(str(error))
        if batch:
            try:
                outputs, stats = self.batched.encode_many(batch)
            except InvalidInput as error:
                for i in where:
                    responses[i] = _error_response(str(error))
            else:
                for i, emb in zip(where, outputs):
                    responses[i] = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("embeddings", emb)])
                self.hits.increment(stats.hits)
                self.misses.increment(stats.misses)
                self.cache_bytes.set(self.cache.used)
        return responses


class PipelineModel:
    """`ensemble`: `triton_vlm.pipeline.Pipeline` over preprocess -> vision_encoder (unary BLS calls,
    each output passed on as it is) -> llm, streamed over the server's own gRPC endpoint
    (`triton_vlm.loopback`: a streamed BLS call's responses are freed without the GIL in this
    Triton, which crashed the stub under load).

    A Triton ensemble would not tell a running decoupled step that its client cancelled or went
    away (Triton 2.51); the pipeline sees it and this model sends the last step a `stop` request
    with the same request id, so the llm ends the request within a step and frees its KV blocks.
    Its sampling inputs are checked (`SamplingParams.from_inputs`) before any step runs.

    Nor does Triton 2.51 end what a decoupled step held when its stub dies: this model watches the
    server's stubs (`triton_vlm.stubs.StepWatch`) and ends the requests waiting on a step that
    died, or on a model it calls, with UNAVAILABLE (`pipeline.restarted`) at once: a unary BLS call
    to it would return only when the supervisor has reloaded it. Each death is counted in
    `triton_vlm_step_restarts_total{model=...}`.
    """

    FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

    def initialize(self, args: dict[str, Any]) -> None:
        _, params = _model_dir(args)
        steps = [Step(s["model"], tuple(s["inputs"]), tuple(s["outputs"]), s.get("skip_when_empty", ""),
                      tuple(s.get("calls", ()))) for s in json.loads(params["steps"])]
        self.final_output = params["final_output"]
        self.steps = GrpcSteps(server_url(), refusal=self._refusal)
        self.pipeline = Pipeline(steps, call=self._call, stream=self._stream, stop=self._stop,
                                 check=SamplingParams.from_inputs, is_empty=lambda tensor: _array(tensor).size == 0,
                                 max_inflight=int(params["max_inflight_requests"]))
        self._labels = {"version": args["model_version"]}
        self._families = [pb_utils.MetricFamily(
            name="triton_vlm_step_restarts_total", description="stub deaths of each model the ensemble calls "
            "(directly or not), as the ensemble saw them; triton-vlm serve reloads the model",
            kind=pb_utils.MetricFamily.COUNTER)]
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
            client = _Client(request.get_response_sender(), frozenset(request.requested_output_names()))
            self.pipeline.submit(inputs, client, request.request_id() or "ensemble")
        return None

    def _refusal(self, model: str) -> Failure | None:
        """A request for `model` while a stub of it is dead and it is not reloaded yet."""
        return restarted(model) if self.watch.down(model) else None

    def _call(self, step: Step, tensors: dict, request_id: str) -> dict:
        refused = self._refusal(step.model)
        if refused is not None:
            raise StepFailed(refused)
        return _bls_call(step.model, tensors, step.outputs, request_id)

    def _stream(self, step: Step, tensors: dict, request_id: str) -> Iterator[Reply]:
        """The last step's responses, as the client's (`self.steps` refuses a step that is down)."""
        arrays = {name: _array(tensor) for name, tensor in tensors.items()}
        for reply in self.steps.stream(step.model, arrays, step.outputs, request_id):
            if isinstance(reply, Failure):
                yield Reply(error=reply)
                continue
            reason = reply.get(self.final_output)
            final = reason is not None and any(bytes(r) for r in reason.reshape(-1))
            yield Reply(outputs=[pb_utils.Tensor(name, array) for name, array in reply.items()], final=final)

    def _stop(self, request_id: str) -> None:
        """tensorrtllm_backend's `stop` request to the last step, over BLS (its one response has
        no tensors)."""
        stop = pb_utils.Tensor("stop", np.array([True]))
        request = pb_utils.InferenceRequest(model_name=self.pipeline.steps[-1].model, request_id=request_id,
                                            inputs=[stop], requested_output_names=[])
        for _ in request.exec(decoupled=True):
            pass

    def finalize(self) -> None:
        self.watch.close()
        self.pipeline.close()
        _release_metrics(self._restarts, self._families)


class _Client:
    """`pipeline.Client` over a decoupled model's response sender. A response holds only the
    outputs the client asked for (`requested`; empty: all), so that the stub never drops one
    without the GIL (`ResponseBuilder`'s note)."""

    def __init__(self, sender, requested: frozenset[str]) -> None:
        self.sender, self.requested = sender, requested

    def send(self, outputs: list, final: bool) -> None:
        if self.requested:
            outputs = [tensor for tensor in outputs if tensor.name() in self.requested]
        self.sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=PipelineModel.FINAL if final else 0)

    def close(self, error: Failure | None = None) -> None:
        if error is None:
            self.sender.send(flags=PipelineModel.FINAL)
        else:
            self.sender.send(_failure_response(error), flags=PipelineModel.FINAL)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


class LLMModel:
    """Decoupled: the engine's scheduler thread sends each request's responses itself."""

    FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

    def initialize(self, args: dict[str, Any]) -> None:
        from triton_vlm.llm.engine import Engine

        version_dir, params = _model_dir(args)
        options = LLMOptions.from_params(params)
        options = dataclasses.replace(options, device=instance_device(args, options.device))
        self.engine = Engine(version_dir / params["checkpoint"], on_failure=_exit_stub, **dataclasses.asdict(options))
        self._next_id = 0
        self._lock = threading.Lock()
        labels = {"model": args["model_name"], "version": args["model_version"]}
        # The families must stay referenced as long as their metrics are used.
        self._families = {
            "blocks": pb_utils.MetricFamily(name="triton_vlm_llm_kv_blocks", description="KV cache pool blocks "
                                            "by state (used, free)", kind=pb_utils.MetricFamily.GAUGE),
            "requests": pb_utils.MetricFamily(name="triton_vlm_llm_requests", description="llm requests by state "
                                              "(running, waiting)", kind=pb_utils.MetricFamily.GAUGE),
            "tokens": pb_utils.MetricFamily(name="triton_vlm_llm_generated_tokens", description="tokens generated "
                                            "by the llm", kind=pb_utils.MetricFamily.COUNTER),
            "token_bytes": pb_utils.MetricFamily(name="triton_vlm_llm_kv_bytes_per_token", description="KV cache "
                                                 "bytes per token (K and V of every attention layer, in the llm's "
                                                 "dtype)", kind=pb_utils.MetricFamily.GAUGE),
        }
        self._metrics = {
            "used": self._families["blocks"].Metric(labels={**labels, "state": "used"}),
            "free": self._families["blocks"].Metric(labels={**labels, "state": "free"}),
            "running": self._families["requests"].Metric(labels={**labels, "state": "running"}),
            "waiting": self._families["requests"].Metric(labels={**labels, "state": "waiting"}),
            "tokens": self._families["tokens"].Metric(labels=labels),
            "token_bytes": self._families["token_bytes"].Metric(labels=labels),
        }
        self._metrics["token_bytes"].set(self.engine.kv_bytes_per_token)
        self._counted_tokens = 0
        self._metrics_stop = threading.Event()
        self._metrics_thread = threading.Thread(target=self._publish_metrics, name="llm-metrics", daemon=True)
        self._metrics_thread.start()

    def _publish_metrics(self, period: float = 0.1) -> None:
        """Copy the engine's counters to the Triton metrics every `period` seconds."""
        while True:
            try:
                engine, m = self.engine, self._metrics
                m["used"].set(engine.kv_blocks_used)
                m["free"].set(engine.kv_blocks_free)
                m["running"].set(engine.num_running)
                m["waiting"].set(engine.num_waiting)
                tokens = engine.num_generated_tokens
                if tokens > self._counted_tokens:
                    m["tokens"].increment(tokens - self._counted_tokens)
                    self._counted_tokens = tokens
            except Exception:
                log.exception("llm metrics update failed")
            if self._metrics_stop.wait(period):
                return

    def _submit(self, request) -> None:
        from triton_vlm.llm.responses import ResponseBuilder

        sender = request.get_response_sender()
        # the ensemble asks for the code in the message: its gRPC stream carries only the message
        tagged = bool(json.loads(request.parameters() or "{}").get(ERROR_CODES, False))
        if _scalar(request, "stop", bool):
            # tensorrtllm_backend's `stop`: end the in-flight request with this request id.
            self.engine.cancel(request.request_id())
            sender.send(flags=self.FINAL)
            return
        try:
            params = SamplingParams.from_inputs({t.name(): t.as_numpy() for t in request.inputs()})
            stream = bool(_scalar(request, "stream", bool) or False)
            args = (_required(request, "input_ids"), _optional(request, "embeddings"),
                    _required(request, "mrope_position_ids"), int(_required(request, "mrope_position_delta").reshape(-1)[0]))
            pruned = dict(media_position_ids=_optional(request, "media_position_ids"),
                          kept_rows=_optional(request, "kept_rows"))
        except InvalidInput as error:
            _send_error(sender, "INVALID_ARG", str(error), tagged)
            return
        request_id = request.request_id()
        if not request_id:
            with self._lock:
                self._next_id += 1
                request_id = f"llm-{self._next_id}"
        builder = ResponseBuilder(params, stream, num_input_tokens=int(args[0].size),
                                  requested=frozenset(request.requested_output_names()))
        emit = _Emitter(sender, builder, tagged)
        try:
            self.engine.submit(request_id, *args, params=params, emit=emit, is_cancelled=sender.is_cancelled, **pruned)
        except InvalidInput as error:
            _send_error(sender, "INVALID_ARG", str(error), tagged)

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        return None

    def finalize(self) -> None:
        self._metrics_stop.set()
        self._metrics_thread.join()
        self.engine.shutdown()
        _release_metrics(self._metrics, self._families)


def _exit_stub(message: str) -> None:
    """The llm engine serves no more (a tensor-parallel rank exited; its requests have had their
    errors): end this stub, so that `triton-vlm serve` reloads the model with new ranks."""
    log.error("llm: %s; exiting the stub for a reload", message)
    os._exit(1)


def _release_metrics(*holders: dict | list) -> None:
    """Drop a model's metrics and metric families in `finalize`, while the stub can still tell the
    server: left to the stub's own teardown, each family's destructor clears its metrics through
    shared memory that is already gone (a segfault of the stub at every server stop, python_backend
    24.10)."""
    for holder in holders:
        holder.clear()


def _send_error(sender, code: str, message: str, tagged: bool) -> None:
    """The final, failing response of an llm request (`tagged`: the code also leads the message,
    `loopback.with_code`)."""
    sender.send(_error_response(with_code(code, message) if tagged else message, getattr(pb_utils.TritonError, code)),
                flags=LLMModel.FINAL)


class _Emitter:
    """Sends a request's responses as its engine outputs come (`ResponseBuilder`); the last one
    carries the FINAL flag."""

    def __init__(self, sender, builder, tagged: bool) -> None:
        self.sender, self.builder, self.tagged = sender, builder, tagged

    def __call__(self, out) -> None:
        if out.error:
            # a request the engine refused for now ("rejected": its queue timeout) may be retried
            code = "UNAVAILABLE" if out.finish_reason == "rejected" else "INTERNAL"
            _send_error(self.sender, code, out.error, self.tagged)
            return
        tensors = self.builder.add(out)
        if tensors is not None:
            response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, v) for n, v in tensors.items()])
            self.sender.send(response, flags=LLMModel.FINAL if out.finished else 0)
