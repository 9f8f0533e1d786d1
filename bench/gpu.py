"""GPU figures of issue 14 in one command (one device call), written as JSON under `--out`.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/gpu.py --out "$OUT"                    # on a GPU
    HF_HUB_OFFLINE=1 .venv/bin/python bench/gpu.py --out DIR --device cpu --quick  # smoke run (tests)

Writes `DIR/gpu.json` (and `DIR/llm.json`, bench/decoder.py's figures, with `--llm`):

- `device`: the device's name, torch and transformers versions, the date;
- `copy_bandwidth_GBps`: bytes read + written per second by a large device-to-device copy
  (bench/decoder.py's `copy_bandwidth`), measured in this run;
- `matmul_bf16_TFLOPs`: the best rate of a bfloat16 [n, n] x [n, n] product, this run;
- `encoder`: Qwen2.5-VL demo checkpoints (`triton_vlm.families.demo`, random weights) with the 7B's
  vision tower (depth 32, hidden 1280, 16 heads, MLP 3420, full attention in blocks 7, 15, 23, 31;
  `--quick`: the `tiny` demo), one per stored dtype of `--weights` (`weights.bfloat16`: stored as
  the real Qwen2.5-VL checkpoints are, so the float32 reference and the bfloat16 towers share their
  weights; `weights.float32`: a bfloat16 tower also rounds the weights, which costs 0.7e-2 on its
  own); for each of `--sizes` (448x448, 1280x720), a batch of `--images` images
  through the checkpoint's own image processor: transformers' tower (`get_image_features`,
  `attn_implementation="eager"`) in float32 as the reference and in bfloat16 for speed, and our
  `torch` encoder back end (`TorchEncoder.encode`: host metadata, host-to-device copies and the
  float32 result back on the host included) in bfloat16 and float16: `max_abs_err` and `rel_err`
  (max |ours - ref| / max |ref|) against the float32 reference, images/s (median of `--repeats`,
  the two interleaved) and `x_transformers` (ours / transformers' eager bfloat16 images/s). Goals
  (issue 14): rel_err within 1e-2 in bfloat16 and at least 2x transformers.

It runs offline and needs neither PyAV, tritonclient nor tritonserver.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

# Qwen2.5-VL-7B's vision tower (its config.json's vision_config).
VISION_7B = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, fullatt_block_indexes=[7, 15, 23, 31])
IMAGE_SIZES = {"448x448": (448, 448), "1280x720": (1280, 720)}
GOALS = {"rel_err_bf16": 1e-2, "x_transformers": 2.0}


def matmul_rate(device, n: int, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` bfloat16 [n, n] x [n, n] products."""
    import torch
    from decoder import sync

    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def timed(fn, device) -> float:
    from decoder import sync

    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def encoder_figures(device, quick: bool, images: int, repeats: int, weights: list[str], sizes: list[str]) -> dict:
    """The encoder figures for a checkpoint of each of `weights` (its stored dtype) and each of `sizes`."""
    out: dict = {"images": images, "weights": {}}
    for stored in weights:
        with tempfile.TemporaryDirectory() as tmp:
            out["weights"][stored] = checkpoint_figures(device, quick, images, repeats, stored, sizes, Path(tmp))
    return out


def checkpoint_figures(device, quick: bool, images: int, repeats: int, stored: str, sizes: list[str],
                       tmp: Path) -> dict:
    import io

    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from triton_vlm.families.demo import write_demo_checkpoint
    from triton_vlm.media import samples
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    overrides = {"dtype": stored, **({} if quick else {"vision": VISION_7B})}
    checkpoint = write_demo_checkpoint("qwen2_5_vl", tmp / "ckpt", "tiny" if quick else "small", overrides=overrides)
    processor = AutoProcessor.from_pretrained(checkpoint)
    hf = {dtype: AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=dtype, attn_implementation="eager")
          .model.to(device).eval() for dtype in (torch.float32, torch.bfloat16)}
    ours = {name: TorchEncoder(checkpoint, str(device), name) for name in ("bfloat16", "float16")}
    vision = json.loads((checkpoint / "config.json").read_text())["vision_config"]
    out: dict = {"checkpoint": {k: vision[k] for k in (*VISION_7B, "out_hidden_size")}, "cases": {}}
    for case in sizes:
        width, height = IMAGE_SIZES[case]
        batch = [Image.open(io.BytesIO(samples.image_bytes(width, height, seed=float(i)))).convert("RGB")
                 for i in range(images)]
        inputs = processor.image_processor(images=batch, return_tensors="pt")
        pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]

        def transformers_tower(dtype):
            with torch.no_grad():
                return torch.cat(hf[dtype].get_image_features(pixels.to(device, dtype), grid.to(device)).pooler_output)

        ref = transformers_tower(torch.float32).float().cpu().numpy().astype(np.float64)
        runs = {"transformers_eager_bf16": lambda: transformers_tower(torch.bfloat16)}
        runs.update({f"torch_{name}": (lambda e=encoder: e.encode(pixels.numpy(), grid.numpy()))
                     for name, encoder in ours.items()})
        times: dict[str, list[float]] = {name: [] for name in runs}
        results = {name: run() for name, run in runs.items()}  # warm-up, and the outputs compared
        for r in range(repeats):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                times[name].append(timed(runs[name], device))
        rate = {name: images / statistics.median(t) for name, t in times.items()}
        hf_bf16 = results["transformers_eager_bf16"].float().cpu().numpy().astype(np.float64)
        scale = np.abs(ref).max()
        figures: dict = {"patches": int(grid.prod(dim=1).sum()),
                         "transformers_eager_bf16_images_per_s": rate["transformers_eager_bf16"],
                         # transformers' own bfloat16 tower against its float32 one: what bfloat16 costs
                         "transformers_eager_bf16_rel_err": float(np.abs(hf_bf16 - ref).max() / scale)}
        for name in ours:
            result = np.asarray(results[f"torch_{name}"], dtype=np.float64)
            err = np.abs(result - ref).max()
            figures[f"torch_{name}"] = {"max_abs_err": float(err), "rel_err": float(err / scale),
                                        "rel_err_vs_transformers_bf16": float(np.abs(result - hf_bf16).max() / scale),
                                        "images_per_s": rate[f"torch_{name}"],
                                        "x_transformers": rate[f"torch_{name}"] / rate["transformers_eager_bf16"]}
        out["cases"][case] = figures
        print(f"encoder, {stored} weights, {case}: {json.dumps(figures)}", flush=True)
    return out


def llm_figures(device: str, quick: bool, out_dir: Path, extra: str) -> dict:
    """bench/decoder.py in its own process (it runs transformers in a child of its own)."""
    path = out_dir / "llm.json"
    args = ["--device", device, "--json", str(path)]
    args += ["--rounds", "1", "--max-tokens", "4", "--concurrency", "1", "--requests", "2"] if quick else []
    command = [sys.executable, str(BENCH / "decoder.py"), *args, *extra.split()]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {"command": command, "error": done.stderr[-4000:]}
    return {"command": command, **json.loads(path.read_text())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for gpu.json (and llm.json)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run (e.g. on the CPU)")
    p.add_argument("--images", type=int, help="images per batch (default 8; --quick 2)")
    p.add_argument("--repeats", type=int, help="timed runs of each (default 5; --quick 1)")
    p.add_argument("--weights", default="bfloat16,float32",
                   help="the demo checkpoint's stored dtypes, one checkpoint each (default bfloat16,float32)")
    p.add_argument("--sizes", default=",".join(IMAGE_SIZES), help=f"image sizes, of {', '.join(IMAGE_SIZES)}")
    p.add_argument("--llm", action=argparse.BooleanOptionalAction, default=True,
                   help="also run bench/decoder.py on the device (default on)")
    p.add_argument("--llm-args", default="", help="more bench/decoder.py arguments, e.g. '--decoder-7b "
                                                  "--dtype bfloat16 --concurrency 1,16,64'")
    args = p.parse_args(argv)

    import torch
    import transformers
    from decoder import copy_bandwidth, device_name

    device = torch.device(args.device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures: dict = {"device": device_name(device), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "torch": torch.__version__, "transformers": transformers.__version__, "goals": GOALS,
                     "copy_bandwidth_GBps": copy_bandwidth(device) / 1e9,
                     "matmul_bf16_TFLOPs": matmul_rate(device, 512 if args.quick else 8192) / 1e12}
    print(json.dumps(figures), flush=True)
    figures["encoder"] = encoder_figures(device, args.quick, args.images or (2 if args.quick else 8),
                                         args.repeats or (1 if args.quick else 5), args.weights.split(","),
                                         args.sizes.split(","))
    (out_dir / "gpu.json").write_text(json.dumps(figures, indent=1))
    if args.llm:
        figures["llm"] = llm_figures(args.device, args.quick, out_dir, args.llm_args)
        (out_dir / "gpu.json").write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
