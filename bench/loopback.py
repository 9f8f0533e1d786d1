"""What the ensemble's calls over the server's own gRPC endpoint cost (`triton_vlm.loopback`), on a
built repository, a server started for the run.

- text `preprocess`: a plain tritonclient call (outputs in the message: the baseline), ours
  (`GrpcSteps.call`: small outputs stay in the message) and ours with every output in shared memory;
- image `preprocess` then `vision_encoder` (ours), against the time the server itself reports for
  each (arrival to response; `vision_encoder_batch`'s includes its dynamic-batching wait).

Usage: HF_HUB_OFFLINE=1 .venv/bin/python bench/loopback.py --repo REPO [--calls 300]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

PREPROCESS_OUTPUTS = ["input_ids", "pixel_values", "grid_thw", "mrope_position_ids", "mrope_position_delta",
                      "video_pruning_rate", "media_position_ids"]


def median_ms(fn, calls: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    import tritonclient.grpc as grpcclient

    from triton_vlm.loopback import SHM_MIN_BYTES, GrpcSteps
    from triton_vlm.samples import image_bytes
    from triton_vlm.server import TritonServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()

    with TritonServer(args.repo) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        steps = GrpcSteps(server.grpc_url)
        text = {"text_input": np.array([b"Tell me about a red car on the road."], dtype=object)}

        def plain() -> None:
            tensor = grpcclient.InferInput("text_input", [1], "BYTES")
            tensor.set_data_from_numpy(text["text_input"])
            client.infer("preprocess", [tensor], outputs=[grpcclient.InferRequestedOutput(n) for n in PREPROCESS_OUTPUTS])

        def ours(sizes=None) -> None:
            steps.call("preprocess", text, PREPROCESS_OUTPUTS, "bench", sizes=sizes)
            steps.release("bench")

        every_output = {name: SHM_MIN_BYTES for name in PREPROCESS_OUTPUTS}
        base = median_ms(plain, args.calls)
        mine = median_ms(ours, args.calls)
        shm = median_ms(lambda: ours(every_output), args.calls)
        print(f"text preprocess: plain tritonclient {base:.2f} ms, ours {mine:.2f} ms ({mine / base:.2f}x), "
              f"every output in shared memory {shm:.2f} ms ({shm / base:.2f}x)")

        image = {"text_input": np.array([b"<|vision_start|><|image_pad|><|vision_end|>Describe."], dtype=object),
                 "images": np.array([image_bytes(448, 448)], dtype=object)}
        spent = {"preprocess": [], "vision_encoder": []}

        def pair() -> None:
            start = time.perf_counter()
            got = steps.call("preprocess", image, PREPROCESS_OUTPUTS, "bench")
            middle = time.perf_counter()
            steps.call("vision_encoder", {k: got[k] for k in ("pixel_values", "grid_thw", "video_pruning_rate")},
                       ["embeddings", "kept_rows"], "bench")
            spent["preprocess"].append(middle - start)
            spent["vision_encoder"].append(time.perf_counter() - middle)
            steps.release("bench")

        models = ("preprocess", "vision_encoder", "vision_encoder_batch")

        def server_stats() -> dict[str, tuple[int, int]]:
            out = {}
            for model in models:
                success = client.get_inference_statistics(model).model_stats[0].inference_stats.success
                out[model] = (success.count, success.ns)
            return out

        for _ in range(10):
            pair()
        spent = {k: [] for k in spent}
        before = server_stats()
        for _ in range(max(args.calls // 5, 10)):
            pair()
        after = server_stats()
        for model in models:
            count, ns = (after[model][i] - before[model][i] for i in (0, 1))
            server_ms = ns / count / 1e6
            line = f"{model}: server {server_ms:.2f} ms"
            if model in spent:
                ms = float(np.median(spent[model])) * 1e3
                line += f", the call {ms:.2f} ms (+{ms - server_ms:.2f} ms)"
            print(line)
        steps.close()


if __name__ == "__main__":
    main()
