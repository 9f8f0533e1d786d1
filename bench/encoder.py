"""Vision encoder benchmark (issue #4): ONNX Runtime vs Hugging Face eager PyTorch, CPU, one run.

    .venv/bin/python bench/encoder.py [--family qwen2_5_vl] [--repeats 5] [--threads 0] [--clock wall|cpu]
                                      [--max-patches-per-run 2048] [--run-sizes 1024,2048,16384]

Writes the `small` demo checkpoint of `--family` (random weights; qwen2_5_vl, glm4v, glm46v,
glmga, minicpmv4_6, minicpmv4_7, llava, llava_onevision) to a temporary folder, exports its vision tower to ONNX
(float32), and times, on the same inputs, interleaved (the two alternate, and which goes first alternates too, so machine noise hits
both alike):

- HF: `model.model.get_image_features(...)` of `AutoModelForImageTextToText` (the tower and its
  merger; float32, eager PyTorch, its default attention implementation), under `torch.no_grad()`;
- ORT: `triton_vlm.vision.runtime.encoder.VisionEncoder.encode` (host metadata included), graph
  optimisations on, intra-op threads = `--threads` (0: every usable core, as the server does for
  one instance); torch uses the same number of threads.

`--clock cpu` times with the process's CPU time instead of the wall clock: with `--threads 1` it
measures the work each side does, unaffected by other processes sharing the cores (with more
threads it would count spin-waiting too).

Inputs come from the checkpoint's own Hugging Face processor: 1, 4 and 16 distinct 448x448 images
and one 1280x720 image. Prints the median seconds of each, the ratio HF / ORT of the medians and
of the best runs (the machine may be shared: the best run is the least disturbed one) and the
relative error of ORT against HF (max |ORT - HF| / max |HF|).

It also prints how far float32 can go on this machine, measured in the same run: the FLOPs of HF's
call (matrix products and attention, `torch.utils.flop_counter`), the peak float32 GEMM rate (the
fastest of torch and ONNX Runtime on 2048^3 and 3072^3 products, same threads and clock), the
share of that peak each side reaches on its best run, and `bound`: the HF / x ratio of an
implementation that did HF's FLOPs at the peak GEMM rate and nothing else (no softmax, norms or
copies): about the best float32 could do on this machine, as measured in this run.

`--run-sizes` times only ONNX Runtime instead, on the 16-image case, once per bound on the patches
of one run (`VisionEncoder`'s `max_patches_per_run`), the encoders interleaved in one process.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen2_5_vl")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--max-patches-per-run", type=int, default=None,
                   help="VisionEncoder's bound on one ONNX Runtime run (default: its own)")
    p.add_argument("--run-sizes", default=None,
                   help="comma-separated max_patches_per_run values: compare those on 16 x 448x448 only")
    args = p.parse_args()

    import numpy as np
    import onnxruntime
    import torch
    import transformers
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from triton_vlm.families.demo import write_demo_checkpoint
    from triton_vlm.media import samples
    from triton_vlm.vision.runtime.encoder import VisionEncoder, default_threads
    from triton_vlm.vision.runtime.export import export_onnx

    clock = time.perf_counter if args.clock == "wall" else time.process_time
    threads = args.threads or default_threads(1)
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_demo_checkpoint(args.family, Path(tmp) / "small", "small")
        onnx_path = export_onnx(checkpoint, Path(tmp) / "encoder.onnx", dtype="float32")
        processor = AutoProcessor.from_pretrained(checkpoint)
        model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
        vision = model.config.vision_config
        tower_params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("lm_head", "model.language_model")))
        run_bound = {} if args.max_patches_per_run is None else {"max_patches_per_run": args.max_patches_per_run}
        encoder = VisionEncoder(onnx_path, intra_op_threads=threads, **run_bound)
        print(f"{args.family} small checkpoint: vision depth {getattr(vision, 'depth', None) or vision.num_hidden_layers}, "
              f"hidden {vision.hidden_size}, {tower_params / 1e6:.1f} M tower parameters; torch {torch.__version__}, "
              f"transformers {transformers.__version__}, onnxruntime {onnxruntime.__version__}; {threads} threads each; "
              f"{args.clock} clock; median of {args.repeats}, interleaved; ORT runs of at most "
              f"{encoder.max_patches_per_run} patches")

        def inputs(sizes):
            """(HF get_image_features arguments, our pixel rows, our grid_thw, our further encode
            arguments): MiniCPM-V's processor packs slices [1, C, patch, L] with `target_sizes`
            [slices, 2]; LLaVA-OneVision's gives each image's views [B, views, C, S, S] (padded) with
            `image_sizes`; LLaVA's gives images [B, C, S, S] and no grid; the others give rows and
            `image_grid_thw` as they are."""
            images = [Image.open(__import__("io").BytesIO(samples.image_bytes(w, h, seed=float(i)))).convert("RGB")
                      for i, (w, h) in enumerate(sizes)]
            out = processor.image_processor(images=images, return_tensors="pt")
            if "image_sizes" in out:
                from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

                from triton_vlm.families.llava.tower import patch_rows

                config, p = model.config, model.config.vision_config.patch_size
                views = [image_size_to_num_patches(s, config.image_grid_pinpoints, config.vision_config.image_size)
                         for s in out["image_sizes"]]
                rows = np.concatenate([patch_rows(out["pixel_values"][i, :v].numpy(), p) for i, v in enumerate(views)])
                grid = np.array([[v, *out["pixel_values"].shape[-2:]] for v in views], dtype=np.int64)
                grid[:, 1:] //= p
                return ((out["pixel_values"], out["image_sizes"]), rows, grid,
                        {"image_sizes": out["image_sizes"].numpy().astype(np.int64)})
            if "target_sizes" in out:
                from triton_vlm.families.minicpmv.tower_v4_6 import patch_rows

                sizes = out["target_sizes"].numpy().astype(np.int64)
                grid = np.concatenate([np.ones_like(sizes[:, :1]), sizes], axis=1)
                return (out["pixel_values"], out["target_sizes"]), patch_rows(out["pixel_values"].numpy()), grid, {}
            if "image_grid_thw" not in out:
                from triton_vlm.families.llava.tower import patch_rows

                b, _, h, w = out["pixel_values"].shape
                p = processor.patch_size
                grid = np.array([[1, h // p, w // p]] * b, dtype=np.int64)
                return (out["pixel_values"],), patch_rows(out["pixel_values"].numpy(), p), grid, {}
            return ((out["pixel_values"], out["image_grid_thw"]), out["pixel_values"].numpy(),
                    out["image_grid_thw"].numpy(), {})

        if args.run_sizes:
            return compare_run_sizes(onnx_path, inputs([(448, 448)] * 16), threads, clock, args.repeats,
                                     [int(v) for v in args.run_sizes.split(",")])
        peak = peak_gemm_rate(threads, clock)
        print(f"peak float32 GEMM rate: {peak / 1e9:.0f} GFLOP/s")
        cases = {"1 x 448x448": [(448, 448)], "4 x 448x448": [(448, 448)] * 4,
                 "16 x 448x448": [(448, 448)] * 16, "1 x 1280x720": [(1280, 720)]}
        print(f"{'case':<14} {'patches':>8} {'HF eager s':>11} {'ORT s':>8} {'HF/ORT':>7} {'best HF':>8} "
              f"{'best ORT':>9} {'HF/ORT':>7} {'rel err':>9} {'GFLOP':>7} {'HF peak':>8} {'ORT peak':>9} {'bound':>7}")
        ratios, best_ratios, bounds = [], [], []
        for name, sizes in cases.items():
            hf_args, px_np, grid_np, extra = inputs(sizes)

            def hf():
                with torch.no_grad():
                    return torch.cat(list(model.model.get_image_features(*hf_args).pooler_output)).numpy()

            def ort():
                return encoder.encode(px_np, grid_np, extra)

            ref, ours = hf(), ort()  # warm-up (and the accuracy check)
            flops = count_flops(hf)
            err = float(np.abs(ours.astype(np.float64) - ref).max() / np.abs(ref).max())
            times = {"hf": [], "ort": []}
            for r in range(args.repeats):
                for which in (("hf", "ort") if r % 2 == 0 else ("ort", "hf")):
                    start = clock()
                    (hf if which == "hf" else ort)()
                    times[which].append(clock() - start)
            t_hf, t_ort = statistics.median(times["hf"]), statistics.median(times["ort"])
            b_hf, b_ort = min(times["hf"]), min(times["ort"])
            ratios.append(t_hf / t_ort)
            best_ratios.append(b_hf / b_ort)
            bounds.append(b_hf * peak / flops)
            print(f"{name:<14} {int(grid_np.prod(1).sum()):>8} {t_hf:>11.3f} {t_ort:>8.3f} {t_hf / t_ort:>6.2f}x "
                  f"{b_hf:>8.3f} {b_ort:>9.3f} {b_hf / b_ort:>6.2f}x {err:>9.1e} {flops / 1e9:>7.1f} "
                  f"{flops / b_hf / peak:>7.0%} {flops / b_ort / peak:>9.0%} {b_hf * peak / flops:>6.2f}x", flush=True)
        def geomean(values):
            return float(np.exp(np.mean(np.log(values))))

        print(f"geometric mean HF/ORT: medians {geomean(ratios):.2f}x, best runs {geomean(best_ratios):.2f}x "
              f"(goal >= 1.5x); float32 bound on this machine {geomean(bounds):.2f}x")
    return 0


def count_flops(fn) -> int:
    """FLOPs of `fn()` as torch's flop counter sees them, plus its CPU flash attention kernel,
    which the counter does not know (2 * L * S * (head_dim + v_dim) per batch and head)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_flash(query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query, key, value)

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    return counter.get_total_flops()


def peak_gemm_rate(threads: int, clock, sizes: tuple[int, ...] = (2048, 3072), repeats: int = 7) -> float:
    """FLOP/s of the fastest n x n x n float32 product of torch and ONNX Runtime over `sizes`, best run."""
    import numpy as np
    import onnxruntime
    import torch
    from onnx import TensorProto, helper, numpy_helper

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    best = 0.0
    for n in sizes:
        a, b = np.random.default_rng(0).standard_normal((2, n, n), dtype=np.float32)
        graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "gemm",
                                  [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n])],
                                  [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])],
                                  [numpy_helper.from_array(b, "b")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        session = onnxruntime.InferenceSession(model.SerializeToString(), options)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        for run in (lambda: torch.mm(ta, tb), lambda: session.run(None, {"a": a})):
            run()
            for _ in range(repeats):
                start = clock()
                run()
                best = max(best, 2 * n ** 3 / (clock() - start))
    return best


def compare_run_sizes(onnx_path, case, threads: int, clock, repeats: int, sizes: list[int]) -> int:
    """ONNX Runtime on one case with each bound on a run's patches, interleaved (the order turns
    round each repeat); prints best and median seconds and the best time against the largest bound's."""
    import statistics

    import numpy as np

    from triton_vlm.vision.runtime.encoder import VisionEncoder

    _, pixels, grid, extra = case
    encoders = {m: VisionEncoder(onnx_path, intra_op_threads=threads, max_patches_per_run=m) for m in sizes}
    reference = encoders[max(sizes)].encode(pixels, grid, extra)
    for m, encoder in encoders.items():  # warm-up, and the check that the results agree
        err = float(np.abs(encoder.encode(pixels, grid, extra) - reference).max() / np.abs(reference).max())
        assert err < 1e-5, (m, err)
    times: dict[int, list[float]] = {m: [] for m in sizes}
    for r in range(repeats):
        for m in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
            start = clock()
            encoders[m].encode(pixels, grid, extra)
            times[m].append(clock() - start)
    base = min(times[max(sizes)])
    print(f"16 x 448x448 ({int(grid.prod(1).sum())} patches), ONNX Runtime only, {threads} threads, "
          f"median of {repeats}, interleaved")
    print(f"{'patches per run':>16} {'best s':>8} {'median s':>9} {'best / largest':>15}")
    for m in sizes:
        print(f"{m:>16} {min(times[m]):>8.3f} {statistics.median(times[m]):>9.3f} {min(times[m]) / base:>14.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
