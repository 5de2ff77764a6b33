"""Behaviour cloning: the training losses compute the reference path's own function, the dataset is the expert's,
and a short run (a minute or so) lowers the loss and drives longer than the same preset with random weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from vla_node.model.checkpoint import load_checkpoint
from vla_node.model.config import preset
from vla_node.model.flow import integrate, tick_noise
from vla_node.model.tokenizer import BIN_BASE, encode
from vla_node.model.vla import build_vla, to_pixels
from vla_node.runtime.reference import ReferencePolicy
from vla_node.sim.instructions import INSTRUCTIONS, KEEP
from vla_node.sim.scenario import Cue
from vla_node.train.dataset import DatasetConfig, generate_episode
from vla_node.train.evaluate import evaluate
from vla_node.train.losses import Losses
from vla_node.train.trainer import TrainConfig, learning_rate, train
from vla_node.validate import ConfigError

TEXTS = ["keep the lane", "change to the left lane", "slow down"]


def _batch(config, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (len(TEXTS), config.image_size, config.image_size, 3), generator=g,
                           dtype=torch.uint8).numpy()
    states = torch.randn(len(TEXTS), config.state_slots, config.state_dim, generator=g)
    return images, states


def _reference(model, image, states, instruction):
    """The reference path holding this sample's frame and two states (slot order as given)."""
    ref = ReferencePolicy(model)
    ref.frames[0] = ref.prepare_frames([image])
    ref.states = [s for s in states]
    return ref


def test_the_bins_loss_sees_the_logits_of_the_reference_path():
    model = build_vla(preset("tiny"), seed=3)
    losses = Losses(model)
    images, states = _batch(model.config)
    ids, valid = losses.instruction_tokens(TEXTS)
    queries = model.query_ids(None).expand(len(TEXTS), -1)
    with torch.no_grad():
        ours = losses.bin_logits(ids, valid, to_pixels(images)[:, None], states, queries)  # [B, H*D, bins]
        for i, text in enumerate(TEXTS):  # instructions of three lengths: the padding is invisible
            ref = _reference(model, images[i], states[i], text)
            logits = ref.decode(encode(text, model.config.max_text_tokens)).logits[:, BIN_BASE:BIN_BASE + 256]
            torch.testing.assert_close(ours[i], logits, atol=1e-5, rtol=1e-5)


def test_the_flow_loss_sees_the_velocity_field_of_the_reference_path():
    model = build_vla(preset("tiny", "flow"), seed=3)
    losses = Losses(model)
    images, states = _batch(model.config, seed=1)
    ids, valid = losses.instruction_tokens(TEXTS)
    pixels = to_pixels(images)[:, None]
    c = model.config
    with torch.no_grad():
        for i, text in enumerate(TEXTS):
            ref = _reference(model, images[i], states[i], text)
            ref.state_count = 1  # the tick's noise index: 0
            expected = ref.decode(encode(text, c.max_text_tokens)).actions

            def field(x, tau):
                return losses.velocity(ids[i:i + 1], valid[i:i + 1], pixels[i:i + 1], states[i:i + 1], x[None],
                                       torch.tensor([tau]))[0]

            chunk = integrate(field, tick_noise(c.action_horizon, c.action_dims, 0, 0), c.flow_steps)
            np.testing.assert_allclose(chunk.numpy(), expected, atol=1e-5)


def test_an_episode_is_the_experts_labels_on_what_the_model_sees():
    config = DatasetConfig(episodes=1, seconds=3.0, sample_every=2)  # a sample every camera frame
    a, b = generate_episode(config, 0), generate_episode(config, 0)
    assert all(np.array_equal(a[k], b[k]) for k in a)  # deterministic by seed and episode
    n = len(a["instructions"])
    assert n == len(range(0, 150, config.sample_every))  # 3 s of 50 Hz ticks, one sample every sample_every
    assert a["images"].shape == (n, 32, 32, 3) and a["chunks"].shape == (n, 4, 2)
    assert set(a["instructions"].tolist()) <= set(range(len(INSTRUCTIONS)))
    assert np.abs(a["chunks"]).max() <= 1.0 and np.isfinite(a["chunks"]).all()
    assert np.array_equal(a["states"][1:, 1], a["states"][:-1, 0])  # the ring's older state: one frame before
    other = generate_episode(config, 1)
    assert not np.array_equal(a["images"], other["images"])


def test_train_config_is_checked_and_the_schedule_warms_up_and_decays():
    with pytest.raises(ConfigError, match="action_head = 'diffusion'"):
        TrainConfig(action_head="diffusion")
    config = TrainConfig(steps=1000, warmup_steps=100, lr=1e-3)
    assert learning_rate(config, 0) == pytest.approx(1e-5)
    assert learning_rate(config, 99) == pytest.approx(1e-3, rel=0.03)  # warm, the cosine barely begun
    assert learning_rate(config, 999) == pytest.approx(1e-4)


@pytest.mark.slow
def test_a_short_run_learns_to_drive_better_than_random_weights(trained_tiny):
    """A minute's run (600 steps, 32 episodes) lowers the loss on its own and on held-out episodes and keeps the car
    on the road longer than random weights; how well it drives varies from run to run (CPU kernels, seeds: measured
    from 14 s to the full 30 s), so what a finished run drives is checked on the kept checkpoint (test_checkpoints)."""
    path, state = trained_tiny
    losses = [loss for _, loss in state["losses"]]
    assert losses[-1] < 0.7 * losses[0], losses
    held_out = [loss for _, loss in state["validation"]]
    assert held_out[-1] < 0.7 * losses[0], (held_out, losses[0])  # generalises past the untrained loss
    cues = (Cue(0.0, KEEP),)
    trained = evaluate(load_checkpoint(path), seeds=(0, 2), seconds=30.0, cues=cues)
    random = evaluate(build_vla(preset("tiny"), seed=0), seeds=(0, 2), seconds=30.0, cues=cues)
    random_s = [d["seconds"] for d in random["drives"]]
    trained_s = [d["seconds"] for d in trained["drives"]]
    assert random["left_road"] == 2 and max(random_s) < 10.0, random_s  # random weights drive off the road at once
    assert sum(trained_s) > 2 * sum(random_s), (trained_s, random_s)


@pytest.mark.slow
def test_a_run_resumes_from_its_snapshot_and_refuses_another_runs_folder(trained_tiny, tmp_path):
    path, state = trained_tiny
    path = Path(shutil.copytree(path, tmp_path / "run"))
    saved = json.loads((path / "train" / "snapshot" / "state.json").read_text())
    assert saved["step"] == state["step"]
    config = TrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved["config"].items()})
    with pytest.raises(ConfigError, match="holds a run of"):
        train(TrainConfig(**{**saved["config"], "lr": 5e-4}), path, progress=False)
    resumed = train(TrainConfig(**{**saved["config"], "steps": config.steps + 20}), path, progress=False)
    assert resumed["step"] == config.steps + 20
    assert resumed["losses"][: len(state["losses"])] == state["losses"]  # the history is kept, not restarted
    assert resumed["losses"][-1][1] < 1.5 * state["losses"][-1][1]  # the optimizer went on where it was


def test_the_state_ring_is_filled_as_the_node_fills_it():
    """The dataset keeps the newest state first; a batch puts them in ring slots with the newest at a random slot k
    and each older one in the slot before (mod slots): what the node's ring holds after any number of decisions."""
    from vla_node.train.trainer import Batches

    model = build_vla(preset("tiny"), seed=0)
    n, slots = 40, 4
    history = np.arange(n * slots * 4, dtype=np.float32).reshape(n, slots, 4)  # [n, slots (newest first), 4]
    data = {"images": np.zeros((n, 32, 32, 3), np.uint8), "instructions": np.zeros(n, np.uint8),
            "states": history, "chunks": np.zeros((n, 4, 2), np.float32)}
    batch = Batches(data, Losses(model), seed=0, validation_from=n).take(np.arange(n), np.random.default_rng(1))
    ring = batch["states"].numpy()
    newest_slots = set()
    for i in range(n):
        k = next(j for j in range(slots) if np.array_equal(ring[i, j], history[i, 0]))
        newest_slots.add(k)
        for age in range(slots):
            assert np.array_equal(ring[i, (k - age) % slots], history[i, age])
    assert newest_slots == set(range(slots))


def test_a_small_model_trains_on_its_four_state_slots():
    model = build_vla(preset("small"), seed=0)
    losses = Losses(model)
    ids, valid = losses.instruction_tokens([KEEP])
    states = torch.zeros(1, model.config.state_slots, model.config.state_dim)
    pixels = torch.zeros(1, 1, 3, model.config.image_size, model.config.image_size)
    loss = losses.bins_loss(ids, valid, pixels, states, torch.zeros(1, 8, 2, dtype=torch.long))
    assert model.config.state_slots == 4 and torch.isfinite(loss)
    assert DatasetConfig(state_slots=4).state_slots == 4
    assert TrainConfig.for_preset("small").dataset().state_slots == 4


def test_a_half_swapped_snapshot_is_recovered_and_too_few_episodes_are_refused(tmp_path):
    from vla_node.train.trainer import _recover_snapshot

    left = tmp_path / "train" / "snapshot.new"
    left.mkdir(parents=True)
    (left / "state.json").write_text("{}")
    (left / "optimizer.safetensors").write_bytes(b"")
    assert _recover_snapshot(tmp_path / "train") == tmp_path / "train" / "snapshot"
    assert (tmp_path / "train" / "snapshot" / "state.json").is_file() and not left.exists()
    with pytest.raises(ConfigError, match=r"episodes = 4: expected more than the 4 held out"):
        TrainConfig(episodes=4)
