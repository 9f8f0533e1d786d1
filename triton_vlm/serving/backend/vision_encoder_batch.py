"""`vision_encoder_batch`: the tower behind Triton's dynamic batcher (a runtime of
`triton_vlm.vision.runtime.backends`, on the instance's GPU or the CPU), with the embedding cache
(`triton_vlm.vision.batching`). One execution gets the requests Triton grouped; their distinct,
uncached items are encoded together and split back per request.

Cache hits and misses are Triton custom metrics (`triton_vlm_encoder_cache_hits` / `_misses`,
items), with `triton_vlm_encoder_cache_bytes` (gauge) beside them, and
`triton_vlm_encoder_patches` (patch rows received) per instance.
"""
from __future__ import annotations

from typing import Any

from triton_vlm.contract.messages import EncoderBatchRequest
from triton_vlm.contract.params import EncoderBatchOptions, instance_device
from triton_vlm.errors import InvalidInput
from triton_vlm.serving.backend import pb


class VisionEncoderBatchModel:
    def initialize(self, args: dict[str, Any]) -> None:
        from triton_vlm.vision.batching import BatchedEncoder, EmbeddingCache
        from triton_vlm.vision.runtime.backends import open_encoder

        version_dir, params = pb.model_dir(args)
        options = EncoderBatchOptions.from_params(params)
        gpu = args.get("model_instance_kind") == "GPU"
        encoder = open_encoder(options, version_dir, instance_device(args, "cuda" if gpu else "cpu"))
        encoder.warmup()
        self.cache = EmbeddingCache(options.cache_bytes)
        self.batched = BatchedEncoder(encoder, self.cache)
        labels = {"model": args["model_name"], "version": args["model_version"]}
        # The metric families must stay referenced as long as their metrics are used.
        self._families = [
            pb.metric_family("triton_vlm_encoder_cache_hits", "media items served from the vision encoder cache "
                             "(or repeated within one batch)", "counter"),
            pb.metric_family("triton_vlm_encoder_cache_misses", "media items the vision encoder computed", "counter"),
            pb.metric_family("triton_vlm_encoder_cache_bytes", "bytes of embeddings held in the vision encoder cache",
                             "gauge"),
        ]
        self.hits, self.misses, self.cache_bytes = (family.Metric(labels=labels) for family in self._families)
        self._families.append(pb.metric_family("triton_vlm_encoder_patches",
                                               "patch rows this encoder instance received", "counter"))
        self.patches = self._families[-1].Metric(labels={**labels, "instance": args["model_instance_name"]})

    def finalize(self) -> None:
        metrics = [self.hits, self.misses, self.cache_bytes, self.patches]
        del self.hits, self.misses, self.cache_bytes, self.patches
        pb.release_metrics(metrics, self._families)

    def execute(self, requests):
        from triton_vlm.vision.batching import batch_items

        responses: list = [None] * len(requests)
        batch, where = [], []
        for i, request in enumerate(requests):
            try:
                batch.append(batch_items(EncoderBatchRequest.from_inputs(pb.getter(request))))
                where.append(i)
                self.patches.increment(len(batch[-1][0]))
            except InvalidInput as error:
                responses[i] = pb.error_response(str(error))
        if batch:
            try:
                outputs, stats = self.batched.encode_many(batch)
            except InvalidInput as error:
                for i in where:
                    responses[i] = pb.error_response(str(error))
            else:
                for i, emb in zip(where, outputs):
                    responses[i] = pb.response({"embeddings": emb})
                self.hits.increment(stats.hits)
                self.misses.increment(stats.misses)
                self.cache_bytes.set(self.cache.used)
        return responses
