"""preprocess: ours against the Hugging Face pipeline, in one run, with equal outputs.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/preprocess.py [--repeats 5]

Cases (media generated here, nothing downloaded):
  (a) one 1920x1080 JPEG: PIL decode + `Qwen2_5_VLProcessor` (fast torchvision image processor)
      against `Preprocessor` on the JPEG bytes;
  (b) a 60 s 1280x720 H.264 MP4 (30 fps) sampled at 2 fps: transformers' `load_video(path,
      backend="pyav")` with the video processor's own `sample_frames` + the processor, against
      `Preprocessor` on the MP4 bytes;
  (c) 16 JPEGs of mixed sizes in one prompt, as (a).

The checkpoint is the tiny demo one with the real Qwen2.5-VL processor sizes (images 3136 ..
12845056 pixels, videos 100352 .. 602112 pixels per frame). Outputs (input_ids, grid_thw,
pixel_values) are checked equal before timing. Runs of ours and the baseline are interleaved
(the machine is shared), and the median of each is reported with the ratio baseline / ours
(`ratio`), and the ratio of the best runs (`best`).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE_PIXELS = (3136, 12845056)
VIDEO_PIXELS = (128 * 28 * 28, 768 * 28 * 28)


def make_checkpoint(out: Path) -> Path:
    from triton_vlm.families.demo import write_demo_checkpoint

    ckpt = write_demo_checkpoint("qwen2_5_vl", out, "tiny")
    path = ckpt / "processor_config.json"
    config = json.loads(path.read_text())
    config["image_processor"]["size"] = {"shortest_edge": IMAGE_PIXELS[0], "longest_edge": IMAGE_PIXELS[1]}
    config["video_processor"]["size"] = {"shortest_edge": VIDEO_PIXELS[0], "longest_edge": VIDEO_PIXELS[1]}
    path.write_text(json.dumps(config, indent=2))
    return ckpt


def make_video(seconds: float, fps: int, width: int, height: int) -> bytes:
    """H.264 MP4 of a gradient with a moving square (frames made by shifting, so generating is quick)."""
    import av

    from triton_vlm.media.samples import _scene

    base = _scene(width * 2, height, 0.0)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as output:
        stream = output.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "veryfast"}
        for i in range(int(seconds * fps)):
            x = (i * 7) % width
            frame = np.ascontiguousarray(base[:, x:x + width])
            s = 64 + (i * 5) % (height - 128)
            frame[s:s + 64, s:s + 64] = (255, 40, 20)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return buffer.getvalue()


def hf_image_case(processor, images: list[bytes]):
    from PIL import Image

    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return processor(text=[IMG * len(images)], images=pil, return_tensors="pt")


def hf_video_case(processor, path: str):
    from transformers.video_utils import load_video

    vp = processor.video_processor
    sampler = partial(vp.sample_frames, fps=2.0, min_frames=vp.min_frames, max_frames=vp.max_frames,
                      temporal_patch_size=vp.temporal_patch_size)
    frames, metadata = load_video(path, backend="pyav", sample_indices_fn=sampler)
    return processor(text=[VID], videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                     return_tensors="pt")


def check_equal(ours, theirs, pix_key: str, grid_key: str) -> float:
    np.testing.assert_array_equal(ours.input_ids, theirs["input_ids"][0].numpy())
    np.testing.assert_array_equal(ours.grid_thw, theirs[grid_key].numpy())
    ref = theirs[pix_key].numpy()
    assert ours.pixel_values.shape == ref.shape, (ours.pixel_values.shape, ref.shape)
    err = float(np.abs(ours.pixel_values - ref).max())
    assert err <= 1e-4, err
    return err


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--video-seconds", type=float, default=60.0)
    args = parser.parse_args()

    import torch
    from transformers import AutoProcessor

    from triton_vlm.media import samples
    from triton_vlm.preprocessing.preprocessor import Preprocessor

    torch.set_num_threads(os.cpu_count() or 1)
    work = Path(tempfile.mkdtemp(prefix="bench-preprocess-"))
    ckpt = make_checkpoint(work / "ckpt")
    processor = AutoProcessor.from_pretrained(ckpt)
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"  # torchvision backend
    ours = Preprocessor(ckpt)
    ours.warmup()

    jpeg = samples.image_bytes(1920, 1080, "JPEG")
    sizes = [(1920, 1080), (1280, 720), (640, 480), (333, 517), (1024, 1024), (800, 600), (300, 200),
             (1600, 900), (720, 1280), (512, 384), (2048, 1536), (96, 96), (1000, 250), (450, 800),
             (1366, 768), (224, 224)]
    mixed = [samples.image_bytes(w, h, "JPEG", seed=i) for i, (w, h) in enumerate(sizes)]
    t0 = time.perf_counter()
    video = make_video(args.video_seconds, 30, 1280, 720)
    video_path = work / "video.mp4"
    video_path.write_bytes(video)
    print(f"media: jpeg {len(jpeg)} B, 16 images {sum(map(len, mixed))} B, "
          f"video {len(video)} B ({time.perf_counter() - t0:.1f} s to encode)")

    cases = {
        "a: 1920x1080 JPEG": (lambda: ours(IMG, [jpeg]), lambda: hf_image_case(processor, [jpeg]),
                              "pixel_values", "image_grid_thw"),
        "b: 60 s 1280x720 H.264, 2 fps": (lambda: ours(VID, [], [video]),
                                          lambda: hf_video_case(processor, str(video_path)),
                                          "pixel_values_videos", "video_grid_thw"),
        "c: 16 mixed JPEGs": (lambda: ours(IMG * len(mixed), mixed), lambda: hf_image_case(processor, mixed),
                              "pixel_values", "image_grid_thw"),
    }
    print(f"{'case':34s} {'ours ms':>9s} {'HF ms':>9s} {'ratio':>7s} {'best':>6s}  max|diff|  output")
    for label, (ours_fn, hf_fn, pix_key, grid_key) in cases.items():
        out, ref = ours_fn(), hf_fn()
        err = check_equal(out, ref, pix_key, grid_key)
        del ref
        t_ours, t_hf = [], []
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            t_hf.append(timed(hf_fn))
            t_ours.append(timed(ours_fn))
        m_ours, m_hf = statistics.median(t_ours), statistics.median(t_hf)
        best = min(t_hf) / min(t_ours)
        print(f"{label:34s} {m_ours * 1e3:9.1f} {m_hf * 1e3:9.1f} {m_hf / m_ours:6.2f}x {best:5.2f}x  {err:.1e}   "
              f"grid {out.grid_thw.tolist()[:2]}{'...' if len(out.grid_thw) > 2 else ''} "
              f"pixel_values {list(out.pixel_values.shape)}", flush=True)


if __name__ == "__main__":
    main()
