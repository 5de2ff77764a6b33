"""Behaviour cloning data: the expert drives the simulator with injected noise, and every sampled frame is labelled
with the expert's clean action chunk from where the car really is.

An episode: a road drawn from its seed (2-4 lanes, time of day, curvature, traffic), a perturbed start (lateral
offset, heading error, speed) so that recoveries are in the data, and one of three instruction plans, given by the
same InstructionGiver as a closed-loop drive:

    keep the lane (45%)                  possibly `slow down` from the middle on
    change to the left lane (30%)        from 0-3 s, `keep the lane` once the car has crossed into the new lane
    slow down (25%)                      possibly `keep the lane` (back to the cruise speed) from the middle on

The car executes the expert's action plus noise (DART, Laskey et al. 2017: an Ornstein-Uhlenbeck process on the
steering, white noise on the acceleration, each episode its own noise level), so the states it visits are those a
slightly imperfect policy visits, and the label is always the clean expert's. Each sample holds what the model sees
(the frame resized to the model's input exactly as the node resizes it, the instruction, the state now and at the
frames before it: the node's state ring holds one state per decision, and it decides once per camera frame) and the
label chunk [H, D].

Episodes are written in shards (npz: no pickle) by worker processes (`python -m vla_node.train.dataset`), so the
two cores share the rendering and an interrupted build keeps its finished shards.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from vla_node.progress import Progress
from vla_node.sim.env import RoadEnv, SimConfig
from vla_node.sim.expert import ExpertConfig, expert_action, expert_chunk
from vla_node.sim.instructions import INSTRUCTIONS, KEEP, LEFT, SLOW
from vla_node.sim.scenario import Cue, InstructionGiver
from vla_node.validate import ConfigError, is_int, is_number, require

SHARD_EPISODES = 4
ARRAYS = ("images", "instructions", "states", "chunks", "truth", "episode")


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    """image_size, horizon and state_slots: the model's input size, chunk length and state ring (its action dims and
    state are the simulator's: [steer, accel] and env.state_vector's values)."""

    image_size: int = 32
    horizon: int = 4
    state_slots: int = 2
    episodes: int = 240
    seconds: float = 14.0
    sample_every: int = 4  # control ticks between samples (4 at 50 Hz: 12.5 a second, every other camera frame; a
                           # multiple of the camera's 2 ticks)
    seed: int = 0
    max_offset_m: float = 1.5
    max_heading: float = 0.08
    speed_range: tuple[float, float] = (8.0, 26.0)
    steer_noise: float = 0.08  # the largest episode's stationary std of the steering noise (action units)
    steer_noise_tau_s: float = 0.5
    accel_noise: float = 0.1

    def __post_init__(self) -> None:
        require(is_int(self.image_size) and 8 <= self.image_size <= 1024, "dataset.image_size", self.image_size,
                "an integer in 8..1024")
        require(is_int(self.horizon) and 1 <= self.horizon <= 256, "dataset.horizon", self.horizon,
                "an integer in 1..256")
        require(is_int(self.state_slots) and 1 <= self.state_slots <= 64, "dataset.state_slots", self.state_slots,
                "an integer in 1..64")
        require(is_int(self.episodes) and self.episodes >= 1, "dataset.episodes", self.episodes, "an integer >= 1")
        require(is_number(self.seconds) and 2 <= self.seconds <= 600, "dataset.seconds", self.seconds,
                "a number of seconds in [2, 600]")
        require(is_int(self.sample_every) and self.sample_every >= 1, "dataset.sample_every", self.sample_every,
                "an integer >= 1")
        require(is_int(self.seed) and self.seed >= 0, "dataset.seed", self.seed, "a non-negative integer")


def _plan(rng: np.random.Generator, seconds: float) -> tuple[Cue, ...]:
    draw = rng.random()
    middle = float(rng.uniform(0.35, 0.6)) * seconds
    if draw < 0.45:
        return (Cue(0.0, KEEP), Cue(middle, SLOW)) if rng.random() < 0.3 else (Cue(0.0, KEEP),)
    if draw < 0.75:
        start = float(rng.uniform(0.0, 3.0))
        return (Cue(0.0, LEFT),) if start < 0.5 else (Cue(0.0, KEEP), Cue(start, LEFT))
    return (Cue(0.0, SLOW), Cue(middle, KEEP)) if rng.random() < 0.4 else (Cue(0.0, SLOW),)


def generate_episode(config: DatasetConfig, episode: int,
                     expert: ExpertConfig = ExpertConfig()) -> dict[str, np.ndarray]:
    """One episode's samples: images [n, S, S, 3] uint8, instructions [n] uint8 (index into INSTRUCTIONS), states
    [n, state_slots, state_dim] float32 (the state at this camera frame, then at each frame before it; the first
    frame's repeated at the start), chunks [n, H, D] float32, truth [n, 3] float32 (lateral offset from the goal lane's
    centre, heading error, speed: for diagnostics), episode [n] int32."""
    from vla_node.model.vla import preprocess_frame

    rng = np.random.default_rng([config.seed, 41, episode])
    cues = _plan(rng, config.seconds)
    lanes = int(rng.integers(2, 5))
    sim = SimConfig(seed=int(rng.integers(2**31)), lanes=lanes, length_m=100.0)
    lane = int(rng.integers(1, lanes)) if any(c.instruction == LEFT for c in cues) else int(rng.integers(0, lanes))
    slow_start = cues[0].instruction == SLOW
    env = RoadEnv(sim, ego_lane=lane, seconds=config.seconds,
                  offset_m=float(rng.uniform(-config.max_offset_m, config.max_offset_m)),
                  heading_error=float(rng.uniform(-config.max_heading, config.max_heading)),
                  speed=float(rng.uniform(sim.slow_mps if slow_start else config.speed_range[0],
                                          config.speed_range[1])))
    giver = InstructionGiver(sim, env.road, cues)
    steer_std = float(rng.uniform(0, config.steer_noise))
    accel_std = float(rng.uniform(0, config.accel_noise))
    decay = math.exp(-env.dt / config.steer_noise_tau_s)
    steer_noise = 0.0
    out: dict[str, list] = {name: [] for name in ARRAYS}
    frame_ticks = round(sim.control_hz / sim.fps)
    require(config.sample_every % frame_ticks == 0, "dataset.sample_every", config.sample_every,
            f"a multiple of the camera's {frame_ticks} control ticks")
    history = collections.deque([env.state_vector()] * config.state_slots, maxlen=config.state_slots)  # newest first
    ticks = round(config.seconds * sim.control_hz)
    vehicle = sim.vehicle
    for tick in range(ticks):
        truth = env.truth()
        if truth.left_road:
            break
        giver.update(truth)
        goal = giver.goal
        if tick % frame_ticks == 0:  # a camera frame: the node takes a decision, and the state ring a state
            history.appendleft(env.state_vector())
        if tick % config.sample_every == 0:
            out["images"].append(np.ascontiguousarray(preprocess_frame(env.frame(), config.image_size)))
            out["instructions"].append(INSTRUCTIONS.index(goal.instruction))
            out["states"].append(np.stack(history))
            out["chunks"].append(expert_chunk(expert, env.road, vehicle, env.ego, env.s, goal,
                                              config.horizon, env.dt))
            out["truth"].append((truth.d - env.road.lane_offset(goal.lane), truth.heading_error, truth.speed))
        steer_noise = steer_noise * decay + steer_std * math.sqrt(1 - decay * decay) * float(rng.standard_normal())
        action = expert_action(expert, env.road, vehicle, env.ego, env.s, goal)
        action = action + np.array([steer_noise, accel_std * float(rng.standard_normal())], np.float32)
        env.step(np.clip(action, -1, 1))
    n, size = len(out["instructions"]), config.image_size
    return {
        "images": np.asarray(out["images"], np.uint8).reshape(n, size, size, 3),
        "instructions": np.asarray(out["instructions"], np.uint8),
        "states": np.asarray(out["states"], np.float32).reshape(n, config.state_slots, -1),
        "chunks": np.asarray(out["chunks"], np.float32).reshape(n, config.horizon, 2),
        "truth": np.asarray(out["truth"], np.float32).reshape(n, 3),
        "episode": np.full(n, episode, np.int32),
    }


# ---- shards on disk ----------------------------------------------------------------------------------------


def shard_count(config: DatasetConfig) -> int:
    return math.ceil(config.episodes / SHARD_EPISODES)


def shard_path(folder: Path, shard: int) -> Path:
    return folder / f"shard-{shard:05d}.npz"


def write_shard(folder: Path, config: DatasetConfig, shard: int) -> Path:
    """Generate shard `shard`'s episodes into folder (written to a temporary name, then renamed: a killed worker
    leaves no half shard)."""
    episodes = range(shard * SHARD_EPISODES, min((shard + 1) * SHARD_EPISODES, config.episodes))
    parts = [generate_episode(config, e) for e in episodes]
    arrays = {name: np.concatenate([p[name] for p in parts]) for name in ARRAYS}
    path = shard_path(folder, shard)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return path


def build_dataset(folder: str | os.PathLike, config: DatasetConfig, workers: int = 2,
                  progress: bool = True) -> dict[str, np.ndarray]:
    """The dataset in `folder` (made or completed there first, by `workers` processes), as arrays in memory. A folder
    made for another dataset is refused by name."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    described = {"dataset": dataclasses.asdict(config)}
    meta = folder / "dataset.json"
    if meta.exists():
        found = json.loads(meta.read_text())
        if found != json.loads(json.dumps(described)):
            raise ConfigError(f"{folder}: holds a dataset of {found}, expected {described}; use another --out or "
                              "delete it")
    else:
        meta.write_text(json.dumps(described, indent=2))
    total = shard_count(config)
    missing = [s for s in range(total) if not shard_path(folder, s).exists()]
    if missing:
        _run_workers(folder, missing, max(1, min(workers, len(missing))), total, progress)
    parts = []
    for s in range(total):
        with np.load(shard_path(folder, s)) as data:
            parts.append({name: data[name] for name in ARRAYS})
    return {name: np.concatenate([p[name] for p in parts]) for name in ARRAYS}


def _run_workers(folder: Path, missing: list[int], workers: int, total: int, progress: bool) -> None:
    """Worker processes over the missing shards (round robin), with a progress bar counting finished shards."""
    procs, logs = [], []
    for w in range(workers):
        shards = ",".join(str(s) for s in missing[w::workers])
        logs.append(folder / f"worker-{w}.log")
        with open(logs[-1], "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "vla_node.train.dataset", str(folder), shards],
                                          stdout=log, stderr=subprocess.STDOUT))
    bar = Progress(len(missing) * SHARD_EPISODES, "dataset", unit="episodes", enabled=progress)
    done = 0
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(0.5)
            now = sum(shard_path(folder, s).exists() for s in missing)
            bar.update((now - done) * SHARD_EPISODES)
            done = now
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        bar.close()
    failed = [(p, log) for p, log in zip(procs, logs) if p.returncode != 0]
    if failed:
        process, log = failed[0]
        last = (log.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"dataset worker exited {process.returncode}: {last} (its log: {log})")
    left = [s for s in missing if not shard_path(folder, s).exists()]
    if left:
        raise RuntimeError(f"{folder}: shards {left[:5]} of {total} were not written")


def main(argv: list[str]) -> int:
    """Worker: python -m vla_node.train.dataset FOLDER SHARD[,SHARD...] (the folder's dataset.json says what)."""
    import torch

    from vla_node.validate import from_dict

    torch.set_num_threads(1)
    folder = Path(argv[0])
    config = from_dict(DatasetConfig, json.loads((folder / "dataset.json").read_text())["dataset"], "dataset")
    for shard in (int(s) for s in argv[1].split(",") if s):
        write_shard(folder, config, shard)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
