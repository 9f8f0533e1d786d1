"""`make demo`: write the default checkpoint, build, serve, stream one image + video answer, stop."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from triton_vlm.clients.chat import load_chat_template, user_prompt
from triton_vlm.clients.client import generate
from triton_vlm.families import DEFAULT_FAMILY, get_family
from triton_vlm.families.demo import write_demo_checkpoint
from triton_vlm.media import samples
from triton_vlm.repository.build import build_repository
from triton_vlm.server.tritonserver import TritonServer

QUESTION = "Describe the picture and what moves in the video."


def run_demo(workdir: Path, size: str = "small", family_name: str = DEFAULT_FAMILY) -> int:
    family = get_family(family_name)
    checkpoint, repo = workdir / f"{family.name}-{size}", workdir / f"repository-{family.name}"
    step = lambda text: print(f"==> {text}", flush=True)  # noqa: E731
    if not (checkpoint / "config.json").exists():
        step(f"writing the {size} {family.name} demo checkpoint (random weights) to {checkpoint}")
        write_demo_checkpoint(family.name, checkpoint, size)
    step(f"building the model repository {repo}")
    build_repository(checkpoint, repo)
    step("starting tritonserver")
    started = time.perf_counter()
    # this machine only: the demo's own client is the one that asks
    with TritonServer(repo, log_file=workdir / "tritonserver.log", host="127.0.0.1") as server:
        step(f"ready in {time.perf_counter() - started:.1f} s ({server.bound()})")
        videos = [samples.video_bytes(2.0)] if family.processor.takes_videos else []
        prompt = user_prompt(load_chat_template(checkpoint), family, QUESTION, images=1, videos=len(videos))
        step(f"one 640x480 JPEG{' + a 2 s 160x120 H.264 video' * len(videos)} + text, streamed over gRPC:")
        result = generate(server.grpc_url, prompt, [samples.image_bytes(640, 480)], videos,
                          max_tokens=32, stream=True, on_text=lambda t: print(t, end="", flush=True))
        print()
        step(f"{len(result.output_ids)} tokens, finish_reason={result.finish_reason}, "
             f"time to first token {result.time_to_first_token:.3f} s, total {result.total_time:.3f} s")
        step("random weights give meaningless text; every step of the pipeline is real")
    step("server stopped")
    return 0


if __name__ == "__main__":
    sys.exit(run_demo(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("build/demo")))
