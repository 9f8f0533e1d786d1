"""The official MiniCPM-V 4.5 golden set (`tests/golden/minicpmv4_5/`, a copy of
`shared/reference/minicpmv4_5/`; its README says how each value was made)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).parent / "golden" / "minicpmv4_5"
CASES = {case["id"]: case for case in json.loads((GOLDEN / "cases.json").read_text())["cases"]}
IMAGE_CASES = [case for case, c in CASES.items() if all(m["kind"] == "image" for m in c["media"])]


@functools.cache
def golden_values() -> dict[str, np.ndarray]:
    """golden.npz's arrays by key (`CASE/NAME`)."""
    with np.load(GOLDEN / "golden.npz") as npz:
        return {key: npz[key] for key in npz.files}
