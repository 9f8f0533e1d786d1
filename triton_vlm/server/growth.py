"""Whether what a long run samples grows: the trend of a series of (seconds, value) samples after
its warm-up, as `bench/soak.py` judges a deployment's threads, descriptors and memory.

Two readings of one series, both over the samples after the warm-up:
- `slope_per_hour`: the least-squares slope, in the value's unit per hour (memory is judged by it,
  as a share of its mean: a process whose memory climbs slowly climbs on every sample);
- `rises`: whether its floor rose above its earlier ceiling: the smallest value of the last
  quarter of the samples is above the largest of the first quarter. Counts that come and go with
  the load (threads of a pool, descriptors of connections) stay inside the band they had; a leak
  of one thread per request or per restart leaves it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Trend:
    first: float            # the value at the end of the warm-up
    last: float             # the last value
    mean: float
    slope_per_hour: float
    rises: bool
    samples: int

    @property
    def percent_per_hour(self) -> float:
        """The slope as a share of the mean, in percent per hour."""
        return 100.0 * self.slope_per_hour / self.mean if self.mean else 0.0


def slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of value over seconds (0 with fewer than two distinct times)."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 0.0 if var == 0 else sum((t - mt) * (v - mv) for t, v in points) / var


def trend(points: list[tuple[float, float]], warmup_s: float) -> Trend | None:
    """The trend of `points` (seconds since the start, value) after `warmup_s`; None with fewer than
    four samples after it."""
    after = sorted(p for p in points if p[0] >= warmup_s)
    if len(after) < 4:
        return None
    values = [v for _, v in after]
    quarter = max(1, len(values) // 4)
    return Trend(first=values[0], last=values[-1], mean=sum(values) / len(values),
                 slope_per_hour=slope(after) * 3600.0,
                 rises=min(values[-quarter:]) > max(values[:quarter]), samples=len(values))
