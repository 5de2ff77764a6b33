"""Micro-benchmark (not a test): segmented vs gather attention over text + vision + action segments.

    vla-node bench attention                   # prints one line per case, ratios side by side

bench_attention() returns the measurements so that the default can be chosen by measurement.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from vla_node.kv.attention import GatherWorkspace, Segment, gather_attention, segmented_attention
from vla_node.kv.dtypes import torch_dtypes

DTYPES = torch_dtypes(("fp32", "bf16"))  # the cases timed


def _median_us(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def bench_attention(
    q_lens: Sequence[int] = (1, 8, 24),
    vision_tokens: Sequence[int] = (196, 392, 784),
    text_tokens: int = 48,
    action_tokens: int = 24,
    n_heads: int = 8,
    n_kv_heads: int = 2,
    head_dim: int = 64,
    dtypes: Sequence[str] = ("fp32", "bf16"),
    repeats: int = 30,
    valid_fraction: float = 0.9,
    device: str = "cpu",
    seed: int = 0,
    threads: int | None = None,
) -> dict[str, Any]:
    """Median microseconds of one attention call (one layer) for every (dtype, q_len, vision size):
    segmented (per-segment partial attention + merge_state) and gather (copy into a preallocated buffer +
    one SDPA). A fraction of the vision and action slots are marked invalid, as in a live cache.

    threads: torch intra-op threads for the run (restored after); on a shared 2-core machine 1 is steadier.

    Returns {"cases": [{dtype, q_len, vision, segmented_us, gather_us, gather_over_segmented}], "config": ...}."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _bench(q_lens, vision_tokens, text_tokens, action_tokens, n_heads, n_kv_heads, head_dim, dtypes,
                      repeats, valid_fraction, device, seed)
    finally:
        torch.set_num_threads(before)


def _bench(q_lens, vision_tokens, text_tokens, action_tokens, n_heads, n_kv_heads, head_dim, dtypes, repeats,
           valid_fraction, device, seed) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for dname, q_len, n_vis in itertools.product(dtypes, q_lens, vision_tokens):
        dtype = DTYPES[dname]

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        segs = []
        for length in (text_tokens, n_vis, action_tokens):
            mask = torch.rand(length, generator=gen).to(device) < valid_fraction
            if length == text_tokens:
                mask = None  # the pinned text partition is all valid
            segs.append(Segment(rand(n_kv_heads, length, head_dim), rand(n_kv_heads, length, head_dim), mask))
        q = rand(n_heads, q_len, head_dim)
        ws = GatherWorkspace(n_kv_heads, head_dim, text_tokens + n_vis + action_tokens, q_len, dtype, device)
        seg_us = _median_us(lambda: segmented_attention(q, segs), repeats)
        gat_us = _median_us(lambda: gather_attention(q, segs, ws), repeats)
        cases.append({"dtype": dname, "q_len": q_len, "vision": n_vis, "segmented_us": round(seg_us, 1),
                      "gather_us": round(gat_us, 1), "gather_over_segmented": round(gat_us / seg_us, 3)})
    return {
        "cases": cases,
        "config": {"text": text_tokens, "action": action_tokens, "n_heads": n_heads, "n_kv_heads": n_kv_heads,
                   "head_dim": head_dim, "repeats": repeats, "threads": torch.get_num_threads(), "device": device},
        "geomean_gather_over_segmented": round(
            math.exp(statistics.fmean(math.log(c["gather_over_segmented"]) for c in cases)), 3),
    }


def run(json_path: str | None = None, threads: int = 1) -> dict:
    """Time every case; print a line per case with the ratio measured side by side; optionally write JSON."""
    result = bench_attention(threads=threads)
    print(f"config: {result['config']}")
    print(f"{'dtype':>5} {'q_len':>5} {'vision':>6} {'segmented_us':>12} {'gather_us':>10} {'gather/seg':>10}")
    for c in result["cases"]:
        print(f"{c['dtype']:>5} {c['q_len']:>5} {c['vision']:>6} {c['segmented_us']:>12} {c['gather_us']:>10} "
              f"{c['gather_over_segmented']:>10}")
    print(f"geometric mean gather/segmented: {result['geomean_gather_over_segmented']}")
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result
