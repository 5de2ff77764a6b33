"""Closed-loop evaluation in this process: a model drives the simulator through the reference path (full recompute,
fp32: the oracle, no cache and no node), on drives of given seeds, with the default instructions.

    evaluate(load_checkpoint("ckpt/tiny"), seeds=(0, 1), seconds=120)

It answers "does this model drive?" quickly and deterministically (no clock, no sockets), for training runs and
tests; `vla-node drive` answers it for the real node in real time.
"""

from __future__ import annotations

import numpy as np
import torch

from vla_node.model.vla import VLA
from vla_node.progress import Progress
from vla_node.runtime.reference import ReferencePolicy
from vla_node.sim.env import RoadEnv, SimConfig
from vla_node.sim.loop import drive_in_process
from vla_node.sim.metrics import aggregate
from vla_node.sim.scenario import Cue, InstructionGiver, default_cues


class ReferenceDriver:
    """The reference path as the loop's policy: one frame, the instruction and the state in, the chunk out."""

    def __init__(self, model: VLA, noise_seed: int = 0) -> None:
        self.policy = ReferencePolicy(model.eval(), noise_seed=noise_seed)

    def __call__(self, frame: np.ndarray, instruction: str, state: np.ndarray) -> np.ndarray:
        return self.policy.step([frame], instruction, state).actions


def evaluate(model: VLA, seeds: tuple[int, ...] = (0,), seconds: float = 120.0, cues: tuple[Cue, ...] | None = None,
             start_offset_m: float = 0.0, progress: bool = False) -> dict:
    """Drive `seconds` on each seed's road; returns {"drives": [summary per seed], and the drives' figures together
    (sim.metrics.aggregate)}."""
    drives = []
    bar = Progress(len(seeds), "evaluate", unit="drives", enabled=progress)
    with torch.inference_mode():
        for seed in seeds:
            config = SimConfig(seed=seed)
            env = RoadEnv(config, seconds=seconds, offset_m=start_offset_m)
            giver = InstructionGiver(config, env.road, cues if cues is not None else default_cues(seconds))
            result = drive_in_process(env, giver, ReferenceDriver(model), seconds)
            drives.append({"seed": seed, **result.summary})
            bar.update(1)
    bar.close()
    return {"drives": drives, **aggregate(drives)}
