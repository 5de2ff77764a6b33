"""A drive with the policy in this process: no node, no sockets, no clock; for training-time evaluation and tests.

At the camera rate the policy gets the frame, the current instruction and the state and returns a chunk [H, D]; the
chunk's step i is applied at the i-th control tick after it (as the node's chunk broker plays it, with no latency);
past its end the fallback action (launch/sim.toml's: wheels straight, braking). `vla-node drive` (drives/closed_loop.py) runs the same world, instructions and
metrics through the real node over ZeroMQ in real time instead.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from vla_node.sim.env import RoadEnv
from vla_node.sim.expert import ExpertConfig, expert_chunk
from vla_node.sim.metrics import DriveMetrics
from vla_node.sim.scenario import InstructionGiver

Policy = Callable[[np.ndarray, str, np.ndarray], np.ndarray]  # (frame HxWx3 uint8, instruction, state) -> [H, D]


@dataclasses.dataclass
class DriveResult:
    summary: dict
    metrics: DriveMetrics
    giver: InstructionGiver


def drive_in_process(env: RoadEnv, giver: InstructionGiver, policy: Policy, seconds: float,
                     fallback_action=(0.0, -1.0)) -> DriveResult:
    """Drive `seconds` of simulated time (or until the car leaves the road)."""
    config = env.config
    fallback = np.asarray(fallback_action, np.float32)
    ticks = round(seconds * config.control_hz)
    frame_period = 1.0 / config.fps
    next_frame_t = 0.0
    metrics = DriveMetrics(config, env.road)
    instruction = None
    chunk, step = None, 0
    for _ in range(ticks):
        truth = env.truth()
        said = giver.update(truth)
        instruction = said if said is not None else instruction
        if env.t >= next_frame_t - 1e-9:
            chunk = np.asarray(policy(env.frame(), instruction, env.state_vector()), np.float32)
            step = 0
            next_frame_t += frame_period
        if chunk is not None and step < len(chunk):
            action, status = chunk[step], "fresh" if step == 0 else "chunk"
        else:
            action, status = fallback, "fallback"
        env.step(action)
        step += 1
        after = env.truth()
        metrics.record(after, giver, action, status)
        if after.left_road:
            break
    return DriveResult(metrics.summary(giver), metrics, giver)


class ExpertPolicy:
    """The expert as a policy (its chunk from the true state toward the giver's goal): what a perfect imitation would
    do, the loop's own check."""

    def __init__(self, env: RoadEnv, giver: InstructionGiver, horizon: int, config: ExpertConfig = ExpertConfig()):
        self.env, self.giver, self.horizon, self.config = env, giver, horizon, config

    def __call__(self, frame: np.ndarray, instruction: str, state: np.ndarray) -> np.ndarray:
        env = self.env
        return expert_chunk(self.config, env.road, env.config.vehicle, env.ego, env.s, self.giver.goal, self.horizon,
                            env.dt)
