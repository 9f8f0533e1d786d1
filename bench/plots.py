"""Draw the benchmark results kept under bench/results/ as the documentation's figures.

    python bench/plots.py [--results bench/results] [--out docs/images/bench]

One SVG per kept JSON, named after it, so a new result draws a new figure on the next run:
- `served-*.json` (bench/served_gpu.py): output tokens/s and time to first token (p50, p99)
  against concurrency, the served ensemble beside the llm engine alone on the same prompts;
- `host_time-*.json` (bench/served_host_time.py): each round's served TTFT against the engine
  alone's, for the tree measured and its base, the gap between them being the served path's own.
Each figure's title names the device and the date, and its caption the command. Also writes
`figures.txt` there, the Markdown that shows them all, which `docs/benchmarks/index.md` includes.
Prints the files written.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BENCH = Path(__file__).resolve().parent
# Figures that do not change when nothing they draw changes: no date, a fixed hash salt.
# Text stays text (searchable, small).
matplotlib.rcParams.update({"svg.hashsalt": "triton-vlm", "svg.fonttype": "none", "figure.dpi": 100, "font.size": 9})
SVG_METADATA = {"Date": None, "Creator": None}


def _caption(fig, figures: dict) -> None:
    fig.text(0.01, 0.01, f"command: {figures.get('command', '?')}", fontsize=6, family="monospace", wrap=True)


def served(figures: dict, title: str):
    """Throughput and TTFT against concurrency, served and engine alone."""
    image, alone = figures["served"]["image"], figures["engine_alone"]
    concurrencies = sorted(image, key=int)
    xs = [int(c) for c in concurrencies]
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(9, 3.8))
    for runs, label, style, color in ((image, "served (ensemble, gRPC streaming)", "o-", "C0"),
                                      (alone, "llm engine alone", "s--", "C1")):
        tput.plot(xs, [runs[c]["output_tokens_per_s"] for c in concurrencies], style, color=color, label=label)
        ttft.plot(xs, [runs[c]["ttft_p50_ms"] for c in concurrencies], style, color=color, label=f"{label}, p50")
        ttft.plot(xs, [runs[c]["ttft_p99_ms"] for c in concurrencies], style, color=color, alpha=0.4,
                  label=f"{label}, p99")
    for ax, what in ((tput, "output tokens/s"), (ttft, "time to first token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ttft.set_yscale("log")
    fig.suptitle(title)
    return fig


def host_time(figures: dict, title: str):
    """Each round's served TTFT and the engine alone's, per tree."""
    runs, trees = figures["runs"], figures.get("trees", {})
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width, offset = 0.4, 0
    labels = []
    for tree, rounds in runs.items():
        xs = [offset + i for i in range(len(rounds))]
        ax.bar(xs, [r["engine_ttft_ms"] for r in rounds], width, label=f"{tree}: llm engine alone")
        ax.bar(xs, [r["served_ttft_ms"] - r["engine_ttft_ms"] for r in rounds], width,
               bottom=[r["engine_ttft_ms"] for r in rounds], label=f"{tree}: served path's own (served - engine)")
        labels += [(x, f"{trees.get(tree, tree).split(' ')[0]}, round {i + 1}") for i, x in enumerate(xs)]
        offset += len(rounds) + 1
    ax.set_xticks([x for x, _ in labels], [label for _, label in labels], rotation=60, fontsize=6)
    ax.set_ylabel("time to first token (ms), concurrency 1")
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylim(top=1.4 * max(r["served_ttft_ms"] for rounds in runs.values() for r in rounds))
    ax.legend(fontsize=7, ncol=2, loc="upper center")
    fig.suptitle(title)
    return fig


DRAW = {"served": served, "host_time": host_time}


def draw(results: Path, out: Path) -> list[Path]:
    """Every kept result that has a drawing, drawn into `out`; the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(results.glob("*.json")):
        kind = path.stem.split("-")[0]
        if kind not in DRAW:
            continue
        figures = json.loads(path.read_text())
        title = f"{kind.replace('_', ' ')}: {figures.get('device', figures.get('command', '').split(' -- ')[-1])}" \
                f" ({figures.get('date', path.stem.rsplit('-', 1)[-1])})"
        fig = DRAW[kind](figures, title)
        _caption(fig, figures)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        target = out / f"{path.stem}.svg"
        fig.savefig(target, metadata=SVG_METADATA)
        plt.close(fig)
        written.append(target)
    listing = out / "figures.txt"
    listing.write_text("".join(f"![{path.stem}](../images/bench/{path.name})\n\n" for path in written))
    return written + [listing]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(BENCH / "results"))
    ap.add_argument("--out", default=str(BENCH.parent / "docs" / "images" / "bench"))
    args = ap.parse_args(argv)
    for path in draw(Path(args.results), Path(args.out)):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
