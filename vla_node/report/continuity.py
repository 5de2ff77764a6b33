"""How continuous the published actions are across chunk boundaries (real-time chunking's figure of merit).

Over consecutive control ticks (seq n, n + 1, neither a fallback), in the Euclidean norm over the action dims:
    chunk_boundary_jump       |a(n+1) - a(n)| where tick n+1 plays a new chunk (another frame's): the step the
                              actuators see when a chunk replaces the one being played
    chunk_step_within         the same within a chunk: the motion the chunks themselves plan, for scale
    chunk_boundary_deviation  |a(n+1) - the previous chunk's own action for tick n+1|: how far the new chunk departs
                              from the plan it replaces (0 for a perfectly continuous replacement). With random
                              weights the chunks' own steps are as large as any jump, so this is the figure that
                              tells a guided replacement from an unguided one
Means; None (JSON null) where no pair qualifies.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 6) if values else None


def chunk_continuity(actions: Sequence) -> dict:
    """actions: ActionRecords (or anything with seq, status, frame_seq, action, chunk, step); those without an
    action vector (older nodes' messages) are skipped."""
    ticks = sorted((a for a in actions if a.action is not None), key=lambda a: a.seq)
    jumps, within, deviations = [], [], []
    for prev, cur in zip(ticks, ticks[1:]):
        if cur.seq != prev.seq + 1 or "fallback" in (prev.status, cur.status):
            continue
        step = float(np.linalg.norm(np.subtract(cur.action, prev.action)))
        if cur.frame_seq == prev.frame_seq:
            within.append(step)
            continue
        jumps.append(step)
        if prev.chunk is not None and prev.step is not None and prev.step + 1 < len(prev.chunk):
            deviations.append(float(np.linalg.norm(np.subtract(cur.action, prev.chunk[prev.step + 1]))))
    return {"chunk_boundaries": len(jumps), "chunk_boundary_jump": _mean(jumps), "chunk_step_within": _mean(within),
            "chunk_boundary_deviation": _mean(deviations)}
