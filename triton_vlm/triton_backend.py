"""The Triton Python-backend side of the models: the only module importing `triton_python_backend_utils`.

Each `model_repository/*/1/model.py` names one class here. A class turns request tensors into
one call into the package and the result back into tensors; `InvalidInput` becomes Triton's
INVALID_ARG with the message as is, so a bad request fails alone.
"""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from triton_vlm import stub_watch
from triton_vlm.errors import BUSY_PREFIX, InvalidInput, busy

log = logging.getLogger("triton_vlm")


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


# A BLS caller in Triton 2.51 gets every error as INTERNAL, whatever its code: refusals for now
# (Triton's queue policy, the llm's queue timeout) are told by their messages and passed on as
# UNAVAILABLE, so a client of a non-decoupled model sees them as such.
_REFUSALS = ("Request timeout expired", "Exceeds maximum queue size", BUSY_PREFIX)


def _bls_error(error) -> pb_utils.TritonError:
    """The error of a BLS response, with the code to pass on."""
    code = error.code()
    if code == pb_utils.TritonError.INTERNAL and any(m in error.message() for m in _REFUSALS):
        code = pb_utils.TritonError.UNAVAILABLE
    return pb_utils.TritonError(error.message(), code)


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
        from triton_vlm.preprocess import Preprocessor

        stub_watch.start()
        version_dir, params = _model_dir(args)
        self.preprocessor = Preprocessor(version_dir / params["checkpoint"], Limits.from_params(params))
        self.preprocessor.warmup()

    def _handle(self, request) -> list:
        text = _text(request, "text_input")
        if text is None:
            raise InvalidInput("text_input: required input is missing")
        options = _text(request, "mm_options")
        try:
            mm_options = json.loads(options) if options else None
        except json.JSONDecodeError as error:
            raise InvalidInput(f"mm_options: not valid JSON ({error.msg})") from None
        out = self.preprocessor(text, _items(request, "images"), _items(request, "videos"), mm_options)
        return [
            pb_utils.Tensor("input_ids", out.input_ids.astype(np.int32, copy=False)),
            pb_utils.Tensor("pixel_values", out.pixel_values.astype(np.float32, copy=False)),
            pb_utils.Tensor("grid_thw", out.grid_thw.astype(np.int64, copy=False)),
            pb_utils.Tensor("mrope_position_ids", out.mrope_position_ids.astype(np.int64, copy=False)),
            pb_utils.Tensor("mrope_position_delta", np.array([out.mrope_position_delta], dtype=np.int64)),
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
        stub_watch.start()
        _, params = _model_dir(args)
        self.batch_model = params["batch_model"]
        self.patch_dim, self.hidden = int(params["patch_dim"]), int(params["hidden"])
        self.merge = int(params["spatial_merge_size"])
        self.max_rows = int(params["max_batch_patches"])

    def _encode_rows(self, pixels: np.ndarray, grid: np.ndarray) -> np.ndarray:
        from triton_vlm.vision.batching import patch_grid

        request = pb_utils.InferenceRequest(
            model_name=self.batch_model, requested_output_names=["embeddings"],
            inputs=[pb_utils.Tensor("pixel_values", np.ascontiguousarray(pixels, dtype=np.float32)),
                    pb_utils.Tensor("patch_grid", patch_grid(grid))])
        response = request.exec()
        if response.has_error():
            error = _bls_error(response.error())
            if error.code() == pb_utils.TritonError.INVALID_ARG:
                raise InvalidInput(error.message())
            if error.code() == pb_utils.TritonError.UNAVAILABLE:
                raise _Unavailable(f"{self.batch_model}: {error.message()}")
            raise RuntimeError(f"{self.batch_model}: {error.message()}")
        return pb_utils.get_output_tensor_by_name(response, "embeddings").as_numpy()

    def _handle(self, request) -> list:
        from triton_vlm.vision.batching import chunk_items
        from triton_vlm.vision.encoder import validate_inputs

        pixels, grid = validate_inputs(_required(request, "pixel_values"), _required(request, "grid_thw"),
                                       self.patch_dim, self.merge)
        # A video's frames go as items of their own (triton_vlm.vision: frames are independent),
        # so a long video splits across batches and each frame is cached on its own.
        grid = np.repeat(np.concatenate([np.ones_like(grid[:, :1]), grid[:, 1:]], axis=1), grid[:, 0], axis=0)
        parts, rows = [], np.concatenate([[0], np.cumsum(grid.prod(axis=1))]).astype(np.int64)
        for first, end in chunk_items(grid, self.max_rows):
            parts.append(self._encode_rows(pixels[rows[first]:rows[end]], grid[first:end]))
        embeddings = np.concatenate(parts, axis=0) if parts else np.zeros((0, self.hidden), np.float32)
        return [pb_utils.Tensor("embeddings", np.ascontiguousarray(embeddings, dtype=np.float32))]

    def execute(self, requests):
        return _serve_each(requests, self._handle)


class VisionEncoderBatchModel:
    """`vision_encoder_batch`: the compiled tower (ONNX Runtime on CPU, TensorRT on GPU) behind
    Triton's dynamic batcher, with the embedding cache. One execution gets the requests Triton
    grouped; their distinct, uncached items are encoded together and split back per request.
    Cache hits and misses are Triton custom metrics (`triton_vlm_encoder_cache_hits` /
    `_misses`, items), with `triton_vlm_encoder_cache_bytes` (gauge) beside them."""

    def initialize(self, args: dict[str, Any]) -> None:
        from triton_vlm.vision.batching import BatchedEncoder, EmbeddingCache

        stub_watch.start()
        version_dir, params = _model_dir(args)
        if params.get("engine_file"):
            from triton_vlm.vision.tensorrt_engine import TensorRTEncoder

            device = int(args.get("model_instance_device_id", "0"))
            encoder = TensorRTEncoder(version_dir / params["engine_file"], device=device)
        else:
            from triton_vlm.vision.encoder import VisionEncoder, default_threads

            threads = int(params.get("intra_op_threads", "0")) or default_threads(int(params.get("instances", "1")))
            encoder = VisionEncoder(version_dir / params["encoder_file"], intra_op_threads=threads)
        encoder.warmup()
        self.cache = EmbeddingCache(int(params.get("cache_bytes", "0")))
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

    def execute(self, requests):
        from triton_vlm.vision.batching import items_from_rows

        responses: list = [None] * len(requests)
        batch, where = [], []
        for i, request in enumerate(requests):
            try:
                pixels = _required(request, "pixel_values")
                grid = items_from_rows(pixels, _required(request, "patch_grid"))
                batch.append((np.asarray(pixels, dtype=np.float32), grid))
                where.append(i)
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
    """`ensemble`: runs preprocess -> vision_encoder -> llm through BLS, streaming the llm's responses.

    A Triton ensemble would not tell a running decoupled step that its client cancelled or went
    away (Triton 2.51); this model watches `is_cancelled()` and sends the last step a `stop`
    request with the same request id, so the llm ends the request within a step and frees its
    KV blocks. Requests beyond `max_inflight_requests` are refused at once with UNAVAILABLE.
    """

    FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

    def initialize(self, args: dict[str, Any]) -> None:
        stub_watch.start()
        _, params = _model_dir(args)
        self.steps: list[dict] = json.loads(params["steps"])
        self.final_output = params["final_output"]
        self.max_inflight = int(params["max_inflight_requests"])
        self._flights: dict[str, _Flight] = {}
        self._lock = threading.Lock()
        self._next_id = 0
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch_cancellations, name="ensemble-cancel", daemon=True)
        self._watcher.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            # Copies: the request's own memory is not ours once execute returns.
            values = {t.name(): t.as_numpy().copy() for t in request.inputs()}
            with self._lock:
                if len(self._flights) >= self.max_inflight:
                    sender.send(_error_response(busy(f"{len(self._flights)} requests in flight, "
                                                     f"max_inflight_requests={self.max_inflight}"),
                                                pb_utils.TritonError.UNAVAILABLE), flags=self.FINAL)
                    continue
                self._next_id += 1
                request_id = f"{request.request_id() or 'ensemble'}-{self._next_id}"
                self._flights[request_id] = flight = _Flight(sender)
            # A daemon thread per request (at most max_inflight_requests): nothing joins a thread
            # that waits on a step when the stub exits.
            threading.Thread(target=self._run, args=(request_id, flight, values), name=f"ensemble-{request_id}",
                             daemon=True).start()
        return None

    def _run(self, request_id: str, flight: "_Flight", values: dict[str, np.ndarray]) -> None:
        try:
            tensors = {name: pb_utils.Tensor(name, value) for name, value in values.items()}
            for step in self.steps[:-1]:
                if flight.is_cancelled():
                    flight.finish(pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED))
                    return
                response = self._request(step, tensors, request_id).exec()
                if response.has_error():
                    flight.finish(_bls_error(response.error()))
                    return
                for name in step["outputs"]:
                    tensors[name] = pb_utils.get_output_tensor_by_name(response, name)
            last = self.steps[-1]
            flight.last_started = True
            for response in self._request(last, tensors, request_id).exec(decoupled=True):
                if flight.done:
                    continue  # drain to the last step's own final response
                if response.has_error():
                    flight.finish(_bls_error(response.error()))
                elif response.output_tensors():
                    reason = pb_utils.get_output_tensor_by_name(response, self.final_output)
                    final = reason is not None and any(bytes(r) for r in reason.as_numpy().reshape(-1))
                    flight.send(pb_utils.InferenceResponse(output_tensors=response.output_tensors()), final)
            flight.finish()
        except Exception:
            log.exception("ensemble request %s failed", request_id)
            flight.finish(pb_utils.TritonError("internal error in the ensemble; see the server log"))
        finally:
            with self._lock:
                self._flights.pop(request_id, None)

    def _request(self, step: dict, tensors: dict, request_id: str) -> "pb_utils.InferenceRequest":
        return pb_utils.InferenceRequest(model_name=step["model"], request_id=request_id,
                                         inputs=[tensors[n] for n in step["inputs"] if n in tensors],
                                         requested_output_names=step["outputs"])

    def _watch_cancellations(self, period: float = 0.02) -> None:
        """One thread polls every request in flight; a cancelled one gets the last step stopped."""
        while not self._stopping.wait(period):
            with self._lock:
                flights = [(rid, f) for rid, f in self._flights.items() if f.last_started and not f.stop_sent]
            for request_id, flight in flights:
                try:
                    if flight.is_cancelled():
                        flight.stop_sent = True
                        # Only fresh tensors: the flight's own may be freed once its last step ends.
                        stop = pb_utils.Tensor("stop", np.array([True]))
                        request = pb_utils.InferenceRequest(model_name=self.steps[-1]["model"], request_id=request_id,
                                                            inputs=[stop], requested_output_names=[])
                        for _ in request.exec(decoupled=True):
                            pass
                except Exception:
                    log.exception("stopping request %s failed", request_id)

    def finalize(self) -> None:
        self._stopping.set()


class _Flight:
    """One `ensemble` request in flight.

    Its sender must not be touched once the final response is out (the request is released
    then: a later `is_cancelled()` reads freed memory in the server), so sending and polling
    go through one lock and stop at `done`.
    """

    def __init__(self, sender) -> None:
        self._sender = sender
        self._lock = threading.Lock()
        self.done = False
        self.last_started = False
        self.stop_sent = False

    def send(self, response, final: bool) -> None:
        with self._lock:
            if not self.done:
                self._sender.send(response, flags=PipelineModel.FINAL if final else 0)
                self.done = final

    def finish(self, error=None) -> None:
        """Send the final response (an error, or just the FINAL flag) unless one was sent."""
        with self._lock:
            if self.done:
                return
            self.done = True
            if error is None:
                self._sender.send(flags=PipelineModel.FINAL)
            else:
                self._sender.send(pb_utils.InferenceResponse(error=error), flags=PipelineModel.FINAL)

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self.done and self._sender.is_cancelled()


class LLMModel:
    """Decoupled: the engine's scheduler thread sends each request's responses itself."""

    FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

    def initialize(self, args: dict[str, Any]) -> None:
        from triton_vlm.llm.engine import Engine

        stub_watch.start()
        version_dir, params = _model_dir(args)
        options = {}
        for key, kind in (("kv_cache_tokens", int), ("kv_cache_bytes", int), ("kv_block_size", int),
                          ("max_running", int), ("max_num_tokens", int), ("queue_timeout_ms", float)):
            if params.get(key):
                options["block_size" if key == "kv_block_size" else key] = kind(params[key])
        options["prefix_caching"] = params.get("prefix_caching", "false").lower() == "true"
        self.engine = Engine(version_dir / params["checkpoint"], device=params.get("device", "cpu"),
                             dtype=params.get("dtype", "float32"), **options)
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

    def _sampling(self, request):
        from triton_vlm.llm.sampling import SamplingParams

        return SamplingParams.from_inputs({t.name(): t.as_numpy() for t in request.inputs()})

    def _submit(self, request) -> None:
        sender = request.get_response_sender()
        if _scalar(request, "stop", bool):
            # tensorrtllm_backend's `stop`: end the in-flight request with this request id.
            self.engine.cancel(request.request_id())
            sender.send(flags=self.FINAL)
            return
        try:
            params = self._sampling(request)
            stream = bool(_scalar(request, "stream", bool) or False)
            args = (_required(request, "input_ids"), _required(request, "embeddings"),
                    _required(request, "mrope_position_ids"), int(_required(request, "mrope_position_delta").reshape(-1)[0]))
        except InvalidInput as error:
            sender.send(_error_response(str(error)), flags=self.FINAL)
            return
        request_id = request.request_id()
        if not request_id:
            with self._lock:
                self._next_id += 1
                request_id = f"llm-{self._next_id}"
        emit = _StreamEmitter(sender) if stream else _CollectingEmitter(sender)
        try:
            self.engine.submit(request_id, *args, params=params, emit=emit, is_cancelled=sender.is_cancelled)
        except InvalidInput as error:
            sender.send(_error_response(str(error)), flags=self.FINAL)

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        return None

    def finalize(self) -> None:
        self._metrics_stop.set()
        self.engine.shutdown()


def _generation_tensors(token_ids: list[int], text: str, finish_reason: str | None) -> list:
    return [
        pb_utils.Tensor("output_ids", np.asarray(token_ids, dtype=np.int32)),
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([(finish_reason or "").encode()], dtype=np.object_)),
    ]


def _send_final_error(sender, out) -> None:
    """A request the engine refused for now ("rejected": its queue timeout) is UNAVAILABLE, the
    client may retry; any other error is INTERNAL."""
    code = pb_utils.TritonError.UNAVAILABLE if out.finish_reason == "rejected" else pb_utils.TritonError.INTERNAL
    sender.send(_error_response(out.error, code), flags=LLMModel.FINAL)


class _StreamEmitter:
    """One response per engine output; the last one carries the FINAL flag."""

    def __init__(self, sender) -> None:
        self.sender = sender

    def __call__(self, out) -> None:
        if out.error:
            _send_final_error(self.sender, out)
            return
        final = out.finish_reason is not None
        self.sender.send(pb_utils.InferenceResponse(output_tensors=_generation_tensors(out.token_ids, out.text, out.finish_reason)),
                         flags=LLMModel.FINAL if final else 0)


class _CollectingEmitter:
    """Non-streaming: one response with everything, sent when the request finishes."""

    def __init__(self, sender) -> None:
        self.sender, self.token_ids, self.text = sender, [], []

    def __call__(self, out) -> None:
        if out.error:
            _send_final_error(self.sender, out)
            return
        self.token_ids.extend(out.token_ids)
        self.text.append(out.text)
        if out.finish_reason is not None:
            self.sender.send(pb_utils.InferenceResponse(
                output_tensors=_generation_tensors(self.token_ids, "".join(self.text), out.finish_reason)),
                flags=LLMModel.FINAL)
