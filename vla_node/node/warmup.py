"""Warm-up: every stage run once untimed, then timed; the measured costs are the scheduler's priors."""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import torch

from vla_node.model.flow import ChunkGuide
from vla_node.runtime.policy import MultiRatePolicy

log = logging.getLogger(__name__)
FRAME_SIZE = (240, 320)  # any size works: frames are resized to the model input as the node's are


def warm_up(policies: dict[str, MultiRatePolicy], instruction: str, state: np.ndarray, sync: Callable[[], None],
            rounds: int = 2, seed: int = 1, denoising_steps: tuple[int, ...] = (), guided: bool = False
            ) -> dict[str, float]:
    """Run each policy's stages (key prefix -> policy, e.g. {"": main, "small_": smaller}) once untimed (first calls
    pay one-off costs: allocator growth, CUDA's lazy kernel and library loading, hundreds of ms on a GPU), then
    `rounds` times timed; a stage's prior (ms) is its slowest timed run. The vision stage runs as the node's frames
    run it: resize, then the update with its tick where the policy can decode it there. First every policy's packed
    matmuls compile their row-bucket kernels (MultiRatePolicy.compile_kernels)."""
    if not (isinstance(rounds, int) and rounds >= 1):
        raise ValueError(f"warm-up rounds = {rounds!r}: expected an integer >= 1")
    rng = np.random.default_rng(seed)
    frames = [rng.integers(0, 256, (*FRAME_SIZE, 3), dtype=np.uint8) for _ in range(rounds + 1)]
    priors: dict[str, float] = {}

    def timed(key: str, fn: Callable[[], object], first: bool) -> None:
        t0 = time.perf_counter_ns()
        fn()
        sync()
        if not first:
            priors[key] = max(priors.get(key, 0.0), (time.perf_counter_ns() - t0) / 1e6)

    for prefix, policy in policies.items():
        t0 = time.perf_counter_ns()
        if compiled := policy.compile_kernels():
            log.info("%spolicy: %d row-bucket kernels of its packed matmuls compiled in %.2f s", prefix, compiled,
                     (time.perf_counter_ns() - t0) / 1e9)
        cameras = policy.config.num_cameras
        c = policy.config
        flow = {"guide": ChunkGuide(torch.zeros(c.action_horizon, c.action_dims), 1, c.action_horizon)} if guided \
            else {}
        for i, frame in enumerate(frames):
            timed(prefix + "text", lambda: policy.update_text(instruction), i == 0)
            timed(prefix + "vision", lambda: policy.update_vision(policy.prepare_frames([frame] * cameras),
                                                                  state=state), i == 0)
            timed(prefix + "action", lambda: policy.action_tick(state, **flow), i == 0)
        for steps in denoising_steps:
            policy.action_tick(state, steps=steps)
    log.info("warm-up priors (ms): %s", {k: round(v, 1) for k, v in priors.items()})
    return priors
