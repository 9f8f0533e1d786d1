"""The official MiniCPM-V 4.5 golden set (`tests/golden/minicpmv4_5/`, a copy of
`shared/reference/minicpmv4_5/`; its README says how each value was made), as its tests name it."""
from __future__ import annotations

from tests.minicpmv_golden import SETS

GOLDEN_SET = SETS["minicpmv4_5"]
GOLDEN, CASES = GOLDEN_SET.root, GOLDEN_SET.cases


def golden_values():
    """golden.npz's arrays by key (`CASE/NAME`)."""
    return GOLDEN_SET.values
