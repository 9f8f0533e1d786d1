"""The documentation: the site builds strictly, the README's quick start is the CLI's, every kept
benchmark result has its figure, and no page cites the tracker's numbers."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results"
FIGURES = ROOT / "docs" / "images" / "bench"
# The result kinds bench/plots.py draws (the prefix of the kept JSON's name).
DRAWN = ("served", "host_time")


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict` (mkdocs.yml's validation: a broken link or anchor, a page left out of
    the nav, a missing snippet, each fails)."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # the README's families table is the families page's (one table: each new family adds one row)
    families = (tmp_path / "site" / "families" / "index.html").read_text()
    table = README.read_text().split("[start:families]")[1].split("[end:families]")[0]
    towers = re.findall(r"^\|[^|]+\|[^|]+\|.+?\| `(\w+Tower)`", table, flags=re.M)
    assert len(towers) >= 16 and all(f"<code>{tower}</code>" in families for tower in towers)


def _shell_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _commands(text: str) -> list[list[str]]:
    """Each `triton-vlm` or `make` command line of the shell blocks (continuations joined, comments
    dropped), as words."""
    lines = []
    for block in _shell_blocks(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += [shlex.split(line, comments=True) for line in joined.splitlines()
                  if re.match(r"\s*(make|\S*triton-vlm)\s", line)]
    return [words for words in lines if words]


def test_every_command_of_the_readme_quick_start_is_the_clis():
    """Each `triton-vlm SUBCOMMAND --flag ...` the README shows is a subcommand whose `--help` lists
    each of those flags; each `make TARGET` a target of the Makefile."""
    commands = _commands(README.read_text())
    cli = [words[words.index(w) + 1:] for words in commands for w in words if w.endswith("triton-vlm")]
    makes = [words[1] for words in commands if words[0] == "make"]
    assert len(cli) >= 4 and {"build", "serve", "infer", "openai"} <= {words[0] for words in cli}
    assert {"demo", "test"} <= set(makes)
    helps: dict[str, str] = {}
    for sub, *rest in cli:
        if sub not in helps:
            done = subprocess.run([sys.executable, "-m", "triton_vlm.tools.cli", sub, "--help"], cwd=ROOT,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"triton-vlm {sub}: {done.stderr}"
            helps[sub] = done.stdout
        for flag in (w.split("=")[0] for w in rest if w.startswith("--")):
            assert re.search(rf"(^|\s|\[){re.escape(flag)}(?![\w-])", helps[sub]), f"triton-vlm {sub} has no {flag}"
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    assert set(makes) <= targets, set(makes) - targets


def test_every_kept_result_has_its_figure(tmp_path):
    """bench/plots.py draws a figure per kept result, and the docs hold the current drawing of each:
    a new result fails this test until `python bench/plots.py` (or `make docs`) has run."""
    kept = sorted(p.stem for p in RESULTS.glob("*.json") if p.stem.split("-")[0] in DRAWN)
    assert kept, "no drawable result under bench/results"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "plots.py"), "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.stem for p in tmp_path.glob("*.svg")) == kept
    assert sorted(p.stem for p in FIGURES.glob("*.svg")) == kept
    assert (tmp_path / "figures.txt").read_text() == (FIGURES / "figures.txt").read_text()


# Upstream projects' trackers may be cited, as links to them; ours may not be cited at all.
_UPSTREAM_LINK = re.compile(r"\[[^\]]*\]\(https://github\.com/(triton-inference-server|grpc)/[^)]*\)")
_TRACKER = re.compile(r"(?<![\w/&])#\d+\b|\b(issues?|PRs?)\s+#?\d+", flags=re.I)


def test_no_page_cites_a_tracker_number():
    pages = [README, ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = []
    for page in pages:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if match := _TRACKER.search(_UPSTREAM_LINK.sub("", line)):
                found.append(f"{page.relative_to(ROOT)}:{n}: {match.group(0)}")
    assert not found, "\n".join(found)
