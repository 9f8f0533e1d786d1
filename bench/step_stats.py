"""Triton's statistics of the ensemble's unary steps, read before and after a measurement and told
apart: the time a request waits in a model's queue, and the time its executions compute.

Triton charges each request of a batched execution the whole execution's compute time (its
`inference_stats.compute_*`), so the per-request compute of a model with dynamic batching counts
one execution as often as it held requests; the per-execution figures come from `batch_stats`
(one entry per batch size, counted per execution). The `vision_encoder` front's compute spans its
whole BLS call to `vision_encoder_batch` (that model's queue and compute inside it):
`own_ms_per_ensemble_request` takes those out.
"""
from __future__ import annotations

from dataclasses import dataclass

STEPS = ("preprocess", "vision_encoder", "vision_encoder_batch")
FRONT, BATCH = "vision_encoder", "vision_encoder_batch"
_COMPUTE = ("compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True)
class Counters:
    """One model's counters at one moment (times in ns)."""
    requests: int = 0
    executions: int = 0
    rows: int = 0           # Triton's inference_count: the batch dimension summed (patch rows of the batch model)
    queue_ns: int = 0       # summed over requests
    compute_ns: int = 0     # summed over requests (a batched execution's time once per request in it)
    execution_ns: int = 0   # summed over executions

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(getattr(self, f) - getattr(other, f) for f in self.__dataclass_fields__))


def _ns(stats: dict, key: str) -> int:
    return int(stats.get(key, {}).get("ns", 0))


def counters(model: dict) -> Counters:
    """The `Counters` of one entry of Triton's `model_stats` (JSON)."""
    infer = model["inference_stats"]
    per_request = sum(_ns(infer, k) for k in _COMPUTE)
    batches = model.get("batch_stats", [])
    per_execution = sum(_ns(b, k) for b in batches for k in _COMPUTE)
    executions = int(model.get("execution_count", 0))
    if not batches:  # no batch statistics: one request an execution
        per_execution = per_request
    return Counters(int(infer["success"].get("count", 0)), executions, int(model.get("inference_count", 0)),
                    _ns(infer, "queue"), per_request, per_execution)


def read(url: str, steps: tuple[str, ...] = STEPS) -> dict[str, Counters]:
    """The counters of `steps` on the server at `url` (gRPC)."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as client:
        stats = client.get_inference_statistics(as_json=True)["model_stats"]
    return {model["name"]: counters(model) for model in stats if model["name"] in steps}


def _ms(ns: float, n: int) -> float:
    return round(ns / 1e6 / n, 2) if n else 0.0


def figures(before: dict[str, Counters], after: dict[str, Counters], ensemble_requests: int) -> dict[str, dict]:
    """Each step's figures between two `read`s: per request of the step and per ensemble request,
    queue and compute apart, per execution, and the mean batch (requests and rows an execution)."""
    deltas = {name: now - before.get(name, Counters()) for name, now in after.items()}
    out = {}
    for name, d in deltas.items():
        out[name] = {
            "requests": d.requests, "executions": d.executions,
            "mean_batch_requests": round(d.requests / d.executions, 2) if d.executions else 0.0,
            "mean_batch_rows": round(d.rows / d.executions, 1) if d.executions else 0.0,
            "queue_ms_per_request": _ms(d.queue_ns, d.requests),
            "compute_ms_per_request": _ms(d.compute_ns, d.requests),  # as Triton charges it
            "compute_ms_per_execution": _ms(d.execution_ns, d.executions),
            # what the step cost one ensemble request: its queue, its executions' own time
            "queue_ms_per_ensemble_request": _ms(d.queue_ns, ensemble_requests),
            "compute_ms_per_ensemble_request": _ms(d.execution_ns, ensemble_requests),
        }
    if FRONT in deltas and BATCH in deltas:  # the front's compute less the batch model's queue and compute inside it
        front, batch = deltas[FRONT], deltas[BATCH]
        out[FRONT]["own_ms_per_ensemble_request"] = _ms(front.compute_ns - batch.queue_ns - batch.compute_ns,
                                                        ensemble_requests)
    return out
