"""Stream an answer about an image from the triton-vlm ensemble with plain tritonclient.grpc.

    python examples/grpc_stream.py --url 127.0.0.1:8001 --image picture.jpg "What is in the picture?"

A decoupled model is served over gRPC streaming only: open a stream, send one request with
`stream=true`, print each `text_output` increment until the response flagged final.
"""
import argparse
import queue

import numpy as np
import tritonclient.grpc as grpcclient

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # Qwen2.5-VL


def tensor(name, value, datatype):
    t = grpcclient.InferInput(name, list(value.shape), datatype)
    t.set_data_from_numpy(value)
    return t


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt")
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--image", required=True)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    prompt = f"<|im_start|>user\n{IMAGE_PLACEHOLDER}{args.prompt}<|im_end|>\n<|im_start|>assistant\n"
    with open(args.image, "rb") as f:
        image = f.read()
    inputs = [
        tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        tensor("images", np.array([image], dtype=np.object_), "BYTES"),
        tensor("max_tokens", np.array([args.max_tokens], dtype=np.int32), "INT32"),
        tensor("stream", np.array([True]), "BOOL"),
    ]
    responses = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
    while True:
        result, error = responses.get(timeout=300)
        if error is not None:
            raise SystemExit(f"error: {error}")
        response = result.get_response()
        if response.outputs:
            print(result.as_numpy("text_output")[0].decode(), end="", flush=True)
        if response.parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    print()


if __name__ == "__main__":
    main()
