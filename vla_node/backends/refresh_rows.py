"""Which rows a partial refresh recomputes beyond the gate's: the shared-drift sample (host side, shared by the
eager caches in runtime/vision_cache.py and the steps' row builders, tower_rows and decoder_rows)."""

from __future__ import annotations

import torch


def shared_sample(rows: torch.Tensor, samples: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows sorted int64 [n] to recompute; adds up to `samples` evenly spaced tokens of the rest (the reused ones), so
    that their change can be measured. mask bool [T] is scratch. Returns (rows and sample, sorted int64 [n'], the
    sample int64 [s])."""
    mask.zero_()
    mask[rows] = True
    reused = mask.logical_not().nonzero().flatten()  # [T - n]
    if samples == 0 or reused.numel() == 0:
        return rows, reused[:0]
    pick = torch.linspace(0, reused.numel() - 1, min(samples, reused.numel())).round().long().unique()
    sample = reused[pick]
    mask[sample] = True
    return mask.nonzero().flatten(), sample
