"""Real-time chunking's bookkeeping in the worker: the chunk being played, and the guide a new flow tick gets.

A flow tick that starts at t decodes a chunk whose step i is for t + i * period (the broker is offered it with
origin t). While it runs, the publisher keeps playing the previous chunk: the new chunk's steps before its arrival,
ceil(delay / period) of them, are played from the previous chunk (frozen), and the previous chunk's remaining steps
beyond them are the target its overlap is guided toward (model/flow.py). The delay is the scheduler's estimate of
the action stage (a quantile with its safety margin: conservative, as the paper advises).
"""

from __future__ import annotations

import numpy as np
import torch

from vla_node.model.flow import ChunkGuide


class RealTimeChunking:
    def __init__(self, horizon: int, dims: int, period_ns: int) -> None:
        self.horizon, self.period_ns = horizon, period_ns
        self.actions = np.zeros((horizon, dims), np.float32)  # the chunk offered last
        self.target = np.zeros((horizon, dims), np.float32)
        self.origin_ns: int | None = None  # the time its step 0 is for; None: no chunk being played
        self.guided = 0  # ticks guided toward a previous chunk
        self.frozen_steps = 0  # their frozen steps, summed

    def guide(self, start_ns: int, delay_ns: int) -> ChunkGuide | None:
        """The guide of a tick starting at start_ns that is expected to take delay_ns; None when no chunk is being
        played or it has no step left at start_ns."""
        if self.origin_ns is None:
            return None
        elapsed = max(0, (start_ns - self.origin_ns) // self.period_ns)  # steps of the old chunk already due
        overlap = self.horizon - elapsed
        if overlap <= 0:
            return None
        frozen = min(overlap, -(-max(0, delay_ns) // self.period_ns))  # ceil(delay / period)
        self.target.fill(0.0)
        self.target[:overlap] = self.actions[elapsed:]
        self.guided += 1
        self.frozen_steps += frozen
        return ChunkGuide(torch.from_numpy(self.target), frozen, overlap)

    def offered(self, actions: np.ndarray, origin_ns: int) -> None:
        np.copyto(self.actions, actions)
        self.origin_ns = origin_ns

    def withdrawn(self) -> None:
        """The chunk stopped playing (the fallback level, a dead camera): nothing to be continuous with."""
        self.origin_ns = None
