"""Small timing helpers for benchmarks (never used in the hot loop)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 1) -> dict[str, float]:
    """Run fn warmup + iters times; median, min and max of the timed runs in ms."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e6)
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": iters}
