"""`triton_vlm.server.growth`: the soak's verdict on a series of samples, and the roles
`triton_vlm.server.process_tree` gives a deployment's processes."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from triton_vlm.server.growth import slope, trend
from triton_vlm.server.process_tree import role, sample


def test_a_steady_leak_rises_and_its_slope_is_per_hour():
    points = [(t, 100 + t / 60) for t in range(0, 3600, 5)]  # one thread a minute
    t = trend(points, warmup_s=600)
    assert t.rises and t.slope_per_hour == pytest.approx(60.0)
    assert t.first == pytest.approx(110.0) and t.samples == len(range(600, 3600, 5))


def test_counts_that_come_and_go_with_the_load_do_not_rise():
    rng = random.Random(0)
    points = [(t, 340 + rng.randint(0, 12)) for t in range(0, 3600, 5)]  # a pool's threads under load
    t = trend(points, warmup_s=600)
    assert not t.rises and abs(t.slope_per_hour) < 3


def test_memory_is_judged_by_its_slope_as_a_share_of_its_mean():
    points = [(t, 4e9 * (1 + 0.01 * t / 3600)) for t in range(0, 7200, 10)]  # +1% of the start an hour
    assert trend(points, warmup_s=0).percent_per_hour == pytest.approx(1.0, rel=0.02)
    assert trend([(t, 5.0) for t in range(10)], warmup_s=0).percent_per_hour == 0
    assert slope([(1.0, 3.0)]) == 0.0 and trend([(t, 1.0) for t in range(5)], warmup_s=2) is None


def test_roles_of_a_process_tree():
    code = "import time; time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        roles = sample(os.getpid(), "test")
        assert roles["test"].threads >= 1 and roles["test"].fds > 0
        assert 0 < roles["test"].pss <= roles["test"].rss  # (its libraries are shared with its child)
        assert role(child.pid) in roles and roles[role(child.pid)].threads >= 1
    finally:
        child.kill()
        child.wait()
