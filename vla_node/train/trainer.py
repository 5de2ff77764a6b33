"""`vla-node train`: behaviour cloning of the expert driver into a checkpoint, seeded and resumable.

    train(TrainConfig(preset="tiny", steps=4000), "ckpt/tiny-bins")

1. The dataset (dataset.py) is built in OUT/train/data (or a folder given) by worker processes, or reused when it
   is there.
2. The model starts from the preset's seeded random weights (the flow head's expert drawn after the trunk, as
   `vla-node init` draws it). AdamW with a linear warm-up and a cosine decay to a tenth, gradient clipping at 1.
   Each step's batch, slot order and flow noise come from (seed, step) alone, so a resumed run takes the same batches
   as an uninterrupted one.
3. Every `save_every` steps (and on Ctrl-C) a snapshot goes to OUT/train/snapshot: the checkpoint, the optimizer's
   moments (safetensors) and state.json (step, loss history, config), written to a new folder and then swapped in,
   so a run killed mid-save resumes from the last whole snapshot. Running the same command again resumes; a larger
   --steps extends a finished run (the schedule then follows the new total).
4. At the end OUT itself is the checkpoint (vla.json, decoder/, vision/, heads, expert/ for flow), loadable by
   `[model] checkpoint = "OUT"`, and OUT/train/state.json holds the loss history and held-out loss.

The last DatasetConfig episodes' 5% (at least one shard) are held out: their loss is measured at every snapshot.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from vla_node.model.action_head import ActionBins
from vla_node.model.checkpoint import load_checkpoint, save_checkpoint
from vla_node.model.config import ModelConfig
from vla_node.model.config import preset as preset_config
from vla_node.model.vla import VLA, build_vla, to_pixels
from vla_node.progress import Progress
from vla_node.sim.env import ACTION_DIMS, STATE_DIM
from vla_node.sim.instructions import INSTRUCTIONS
from vla_node.train.dataset import SHARD_EPISODES, DatasetConfig, build_dataset
from vla_node.train.losses import Losses
from vla_node.validate import ConfigError, choose, is_int, is_number, require

VALIDATION_SAMPLES = 512
# What a run of each preset takes unless told otherwise: tiny trains in about 5 minutes on a 2-core CPU; small, whose
# step of 16 samples at 224 px takes about 7 s there, in under an hour (fewer episodes, a smaller batch, a lower rate);
# base is for a GPU.
PRESET_RUNS = {
    "tiny": dict(steps=4000, batch_size=64, episodes=240, lr=1e-3),
    "small": dict(steps=400, batch_size=16, episodes=40, lr=3e-4),
    "base": dict(steps=2000, batch_size=16, episodes=64, lr=1e-4),
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    preset: str = "tiny"
    action_head: str = "bins"
    steps: int = 4000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 200
    weight_decay: float = 0.01
    seed: int = 0
    episodes: int = 240
    save_every: int = 500
    workers: int = 2  # dataset worker processes
    threads: int = 0  # torch threads while training (0: every core)
    flow_noise_scale: float = 0.1  # the flow head's noise (model.flow_noise_scale): about the expert's action scale

    def __post_init__(self) -> None:
        require(self.preset in ("tiny", "small", "base"), "preset", self.preset, "tiny, small or base")
        require(self.action_head in ("bins", "flow"), "action_head", self.action_head, "'bins' or 'flow'")
        for key in ("steps", "batch_size", "episodes", "save_every", "workers"):
            value = getattr(self, key)
            require(is_int(value) and value >= 1, key, value, "an integer >= 1")
        for key in ("warmup_steps", "seed", "threads"):
            value = getattr(self, key)
            require(is_int(value) and value >= 0, key, value, "an integer >= 0")
        require(is_number(self.lr) and 0 < self.lr < 1, "lr", self.lr, "a learning rate in (0, 1)")
        require(is_number(self.weight_decay) and 0 <= self.weight_decay < 1, "weight_decay", self.weight_decay,
                "a number in [0, 1)")
        require(is_number(self.flow_noise_scale) and self.flow_noise_scale > 0, "flow_noise_scale",
                self.flow_noise_scale, "a number > 0")
        require(self.episodes > self.held_out_episodes, "episodes", self.episodes,
                f"more than the {self.held_out_episodes} held out (5%, at least {SHARD_EPISODES})")

    def model(self) -> ModelConfig:
        """The model trained: the preset's shapes with the action head (flow: with flow_noise_scale)."""
        config = preset_config(self.preset, self.action_head)
        return config.replace(flow_noise_scale=self.flow_noise_scale) if self.action_head == "flow" else config

    @classmethod
    def for_preset(cls, preset: str, **changes) -> "TrainConfig":
        """The run of `preset` (PRESET_RUNS) with `changes`."""
        choose("preset", preset, PRESET_RUNS)
        return cls(preset=preset, **{**PRESET_RUNS[preset], **changes})

    def dataset(self) -> DatasetConfig:
        model = self.model()
        return DatasetConfig(image_size=model.image_size, horizon=model.action_horizon, state_slots=model.state_slots,
                             episodes=self.episodes, seed=self.seed)

    @property
    def held_out_episodes(self) -> int:
        """The last episodes, kept out of training: 5% and at least one shard."""
        return max(SHARD_EPISODES, self.episodes // 20)

    def same_run(self, other: "TrainConfig") -> bool:
        """Whether `other` continues this run (only the step count, saving and threads may differ)."""
        keep = {"steps", "save_every", "workers", "threads"}
        return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(self) if f.name not in keep)


def learning_rate(config: TrainConfig, step: int) -> float:
    warm = min(1.0, (step + 1) / max(config.warmup_steps, 1))
    progress = min(1.0, step / max(config.steps - 1, 1))
    return config.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Batches:
    """The dataset as tensors, and the batch of any step (a function of seed and step alone)."""

    def __init__(self, data: dict[str, np.ndarray], losses: Losses, seed: int, validation_from: int) -> None:
        self.data, self.losses, self.seed = data, losses, seed
        self.train_count = validation_from
        self.size = len(data["instructions"])
        self.text_ids, self.text_valid = losses.instruction_tokens(list(INSTRUCTIONS))
        self.bins = ActionBins(losses.config)

    def take(self, index: np.ndarray, generator: np.random.Generator) -> dict[str, torch.Tensor]:
        d = self.data
        instruction = torch.from_numpy(d["instructions"][index].astype(np.int64))
        history = d["states"][index]  # [B, slots, state_dim]: the newest first
        slots = history.shape[1]
        newest = generator.integers(0, slots, len(index))  # [B] the ring slot the newest state is in
        age = (newest[:, None] - np.arange(slots)[None, :]) % slots  # [B, slots] how old each ring slot's state is
        states = np.take_along_axis(history, age[:, :, None], axis=1)  # [B, slots, state_dim] in ring order
        images = d["images"][index]  # [B, S, S, 3]
        return {
            "text_ids": self.text_ids[instruction], "text_valid": self.text_valid[instruction],
            "pixels": to_pixels(images)[:, None],  # [B, 3, S, S] -> [B, C = 1, 3, S, S]
            "states": torch.from_numpy(np.ascontiguousarray(states)),
            "chunks": torch.from_numpy(d["chunks"][index]),
        }

    def for_step(self, step: int, batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Generator]:
        rng = np.random.default_rng([self.seed, 51, step])
        batch = self.take(rng.integers(0, self.train_count, batch_size), rng)
        generator = torch.Generator().manual_seed(int(rng.integers(2**31)))
        return batch, generator

    def validation(self) -> tuple[dict[str, torch.Tensor], torch.Generator]:
        rng = np.random.default_rng([self.seed, 52])
        count = min(VALIDATION_SAMPLES, self.size - self.train_count)
        index = rng.choice(np.arange(self.train_count, self.size), count, replace=False)
        return self.take(index, rng), torch.Generator().manual_seed(int(rng.integers(2**31)))


def batch_loss(losses: Losses, batches: Batches, batch: dict[str, torch.Tensor],
               generator: torch.Generator) -> torch.Tensor:
    args = (batch["text_ids"], batch["text_valid"], batch["pixels"], batch["states"])
    if losses.config.action_head == "bins":
        target = torch.from_numpy(batches.bins.to_bins(batch["chunks"].numpy()))
        return losses.bins_loss(*args, target)
    return losses.flow_loss(*args, batch["chunks"], generator)


# ---- snapshots ----------------------------------------------------------------------------------------------


def _save_snapshot(out: Path, model: VLA, optimizer: torch.optim.Optimizer, state: dict) -> None:
    folder = out / "train"
    fresh, current, old = folder / "snapshot.new", folder / "snapshot", folder / "snapshot.old"
    shutil.rmtree(fresh, ignore_errors=True)
    save_checkpoint(model, fresh)
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            s = optimizer.state.get(p)
            if s:
                name = names[id(p)]
                moments[f"{name}:exp_avg"] = s["exp_avg"].contiguous()
                moments[f"{name}:exp_avg_sq"] = s["exp_avg_sq"].contiguous()
                moments[f"{name}:step"] = torch.as_tensor(s["step"], dtype=torch.float32).reshape(1)
    save_file(moments, str(fresh / "optimizer.safetensors"))
    (fresh / "state.json").write_text(json.dumps(state, indent=1))
    shutil.rmtree(old, ignore_errors=True)
    if current.exists():
        os.replace(current, old)
    os.replace(fresh, current)
    shutil.rmtree(old, ignore_errors=True)


def _recover_snapshot(folder: Path) -> Path:
    """folder/snapshot; where a run was killed between its two renames (_save_snapshot), the whole snapshot it
    left, the new one first, is put back there."""
    current = folder / "snapshot"
    if not current.exists():
        for left in (folder / "snapshot.new", folder / "snapshot.old"):
            if (left / "state.json").is_file() and (left / "optimizer.safetensors").is_file():
                os.replace(left, current)
                break
    return current


def _load_snapshot(folder: Path, model: VLA, optimizer: torch.optim.Optimizer) -> None:
    moments = load_file(str(folder / "optimizer.safetensors"))
    for name, p in model.named_parameters():
        if f"{name}:exp_avg" in moments:
            optimizer.state[p] = {"exp_avg": moments[f"{name}:exp_avg"], "exp_avg_sq": moments[f"{name}:exp_avg_sq"],
                                  "step": moments[f"{name}:step"].reshape(())}


def _check_model(model: VLA) -> None:
    c = model.config
    require(c.action_dims == ACTION_DIMS and c.state_dim == STATE_DIM, "model", c.name,
            f"a model with action_dims {ACTION_DIMS} (steer, accel) and state_dim {STATE_DIM} (the simulator's)")


# ---- the run ------------------------------------------------------------------------------------------------


def train(config: TrainConfig, out: str | os.PathLike, *, data_dir: str | os.PathLike | None = None,
          progress: bool = True) -> dict:
    """Train (or resume) into `out`; returns the final state (step, losses, held-out loss, seconds). data_dir: the
    dataset's folder (default out/train/data; runs of one preset and seed, both heads, can share one)."""
    out = Path(out)
    snapshot = _recover_snapshot(out / "train")
    state = {"config": dataclasses.asdict(config), "step": 0, "losses": [], "validation": [], "seconds": 0.0}
    if (snapshot / "state.json").exists():
        saved = json.loads((snapshot / "state.json").read_text())
        earlier = TrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved["config"].items()})
        if not earlier.same_run(config):
            raise ConfigError(f"{out}: holds a run of {saved['config']}, not this one ({dataclasses.asdict(config)}); "
                              "use another --out")
        require(config.steps >= saved["step"], "steps", config.steps, f">= the {saved['step']} steps already taken")
        state.update(saved, config=dataclasses.asdict(config))
        model = load_checkpoint(snapshot).train()
        print(f"train: resuming {out} at step {state['step']} of {config.steps}", flush=True)
    else:
        model = build_vla(config.model(), seed=config.seed).train()
    _check_model(model)
    data_config = config.dataset()
    t0 = time.monotonic()
    data = build_dataset(Path(data_dir) if data_dir is not None else out / "train" / "data", data_config,
                         workers=config.workers, progress=progress)
    validation_from = int(np.searchsorted(data["episode"], config.episodes - config.held_out_episodes))
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads or os.cpu_count() or 1)
    losses = Losses(model)
    batches = Batches(data, losses, config.seed, validation_from)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    if state["step"] > 0:
        _load_snapshot(snapshot, model, optimizer)
    print(f"train: {config.preset} {config.action_head}, {batches.train_count} samples "
          f"({batches.size - batches.train_count} held out), batch {config.batch_size}, steps {config.steps}",
          flush=True)
    try:
        _loop(config, model, optimizer, losses, batches, state, out, progress, t0)
    finally:
        torch.set_num_threads(threads)
    save_checkpoint(model.eval(), out)
    (out / "train" / "state.json").write_text(json.dumps(state, indent=1))
    return state


def _loop(config: TrainConfig, model: VLA, optimizer: torch.optim.Optimizer, losses: Losses, batches: Batches,
          state: dict, out: Path, progress: bool, t0: float) -> None:
    bar = Progress(config.steps, f"train {config.preset} {config.action_head}", unit="steps", enabled=progress)
    bar.update(state["step"])
    window: list[float] = []
    stop = {"signal": None}
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.update(signal=signum))
    elapsed0 = state["seconds"]
    try:
        while state["step"] < config.steps and stop["signal"] is None:
            step = state["step"]
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(config, step)
            batch, generator = batches.for_step(step, config.batch_size)
            loss = batch_loss(losses, batches, batch, generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            window.append(float(loss.detach()))
            state["step"] = step + 1
            bar.update(1)
            if len(window) == 50 or state["step"] == config.steps:
                state["losses"].append([state["step"], float(np.mean(window))])
                window = []
            if state["step"] % config.save_every == 0 or state["step"] == config.steps:
                state["validation"].append([state["step"], validation_loss(losses, batches)])
                state["seconds"] = elapsed0 + time.monotonic() - t0
                _save_snapshot(out, model, optimizer, state)
    finally:
        signal.signal(signal.SIGINT, previous)
        bar.close()
    if window:  # an interrupted run keeps the losses of its last steps too
        state["losses"].append([state["step"], float(np.mean(window))])
    if stop["signal"] is not None:
        state["seconds"] = elapsed0 + time.monotonic() - t0
        _save_snapshot(out, model, optimizer, state)
        print(f"train: interrupted at step {state['step']}; run the same command again to resume", flush=True)
        raise KeyboardInterrupt
    state["seconds"] = elapsed0 + time.monotonic() - t0


@torch.no_grad()
def validation_loss(losses: Losses, batches: Batches) -> float:
    batch, generator = batches.validation()
    return float(batch_loss(losses, batches, batch, generator))
