"""The flow head: the Euler integrator, the cached flow tick against the reference path, real-time chunking's
guidance, checkpoints with an expert."""

import dataclasses

import numpy as np
import pytest
import torch

from helpers.model_checks import frames_and_states
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from vla_node.model.config import preset
from vla_node.model.flow import ChunkGuide, integrate, soft_mask, tick_noise
from vla_node.model.vla import build_vla
from vla_node.runtime.policy import MultiRatePolicy, StageAborted
from vla_node.runtime.reference import ReferencePolicy
from vla_node.validate import ConfigError


def flow_config(state="prefix", **changes):
    return preset("tiny", "flow").replace(flow_state=state, **changes)


@pytest.mark.parametrize("steps", [1, 3, 10])
def test_euler_is_exact_on_the_straight_field_toward_one_chunk(steps):
    """dx/dtau = (y - x) / (1 - tau) (linear in x) carries noise to y along x_tau = tau y + (1 - tau) noise; Euler
    stays on that line at every step, so N steps land on y for any N."""
    y, noise = torch.randn(4, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    taus = []

    def field(x, tau):
        taus.append(tau)
        return (y - x) / (1.0 - tau)

    assert torch.allclose(integrate(field, noise, steps), y, atol=1e-12, rtol=0)
    assert taus == [i / steps for i in range(steps)]


def test_euler_on_a_field_of_tau_alone_is_the_left_riemann_sum():
    """dx/dtau = 2 tau: the exact solution gains 1; N Euler steps gain sum 2 i/N^2 = (N - 1) / N."""
    for steps in (1, 2, 5):
        x = integrate(lambda x, tau: torch.full_like(x, 2 * tau), torch.zeros(3, 1, dtype=torch.float64), steps)
        assert torch.allclose(x, torch.full_like(x, (steps - 1) / steps))


def test_the_integrator_refuses_a_step_count_that_is_not_a_positive_integer():
    for steps in (0, -1, 2.0):
        with pytest.raises(ValueError, match=f"denoising steps {steps!r}"):
            integrate(lambda x, tau: x, torch.zeros(2, 2), steps)


def run_both(config, cache, steps=None, frames=6, guide_from=None, tick_prefix=True):
    """The cached policy and the reference over `frames` frames (instruction changed before the fourth); with
    `guide_from` the ticks from that frame on are guided toward the previous chunk (real-time chunking). Returns
    the (cached, reference) chunks."""
    policy = MultiRatePolicy(build_vla(config, seed=3), dataclasses.replace(cache, tick_prefix=tick_prefix))
    reference = ReferencePolicy(build_vla(config, seed=3))
    ours, theirs = [], []
    for i, (frame, state) in enumerate(frames_and_states(frames, seed=1)):
        instruction = "keep the lane" if i < 3 else "change to the left lane"
        guide = None
        if guide_from is not None and i >= guide_from:
            guide = ChunkGuide(torch.from_numpy(theirs[-1].actions), frozen=1, overlap=3)
        if instruction != policy.instruction:
            policy.update_text(instruction)
        policy.update_vision(policy.prepare_frames([frame]))
        ours.append(policy.action_tick(state, steps=steps, guide=guide))
        theirs.append(reference.step([frame], instruction, state, steps=steps, guide=guide))
    return ours, theirs


def max_diff(ours, theirs):
    return max(float(np.abs(a.actions - b.actions).max()) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("state", ["prefix", "suffix"])
@pytest.mark.parametrize("tick_prefix", [True, False])
def test_the_cached_flow_tick_equals_the_reference_with_an_instruction_change(state, tick_prefix):
    ours, theirs = run_both(flow_config(state), CacheConfig.exact(), tick_prefix=tick_prefix)
    assert max_diff(ours, theirs) <= 1e-4
    assert all(c.bins is None and c.logits is None and c.denoising_steps == 10 for c in ours)
    assert all(c.actions.shape == (4, 2) and c.actions.dtype == np.float32 for c in ours)


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_n_steps_of_the_cached_tick_match_n_steps_of_the_reference(steps):
    ours, theirs = run_both(flow_config(), CacheConfig.exact(), steps=steps, frames=3)
    assert max_diff(ours, theirs) <= 1e-4
    assert {c.denoising_steps for c in ours} == {steps}


@pytest.mark.parametrize("tick_prefix", [True, False])
def test_a_guided_tick_equals_the_guided_reference_and_keeps_the_frozen_steps(tick_prefix):
    ours, theirs = run_both(flow_config(), CacheConfig.exact(), frames=4, guide_from=2, tick_prefix=tick_prefix)
    assert max_diff(ours, theirs) <= 1e-4
    for i in (2, 3):  # frozen = 1: the first step is the previous chunk's (the reference's), bit for bit
        assert np.array_equal(ours[i].actions[:1], theirs[i - 1].actions[:1])


def test_guidance_pulls_the_overlap_toward_the_previous_chunk():
    """The same tick (same noise) with and without guidance toward the previous chunk: its guided steps (1, 2: the
    soft mask's weights 0.37 and 0.08 there) come closer to the previous chunk's."""
    plain, _ = run_both(flow_config(), CacheConfig.exact(), frames=2)
    guided, _ = run_both(flow_config(), CacheConfig.exact(), frames=2, guide_from=1)
    target = plain[0].actions
    off = np.abs(plain[1].actions[1:3] - target[1:3]).mean()
    on = np.abs(guided[1].actions[1:3] - target[1:3]).mean()
    assert on < 0.8 * off, (on, off)


def test_the_soft_mask_is_the_papers_schedule():
    w = soft_mask(8, 2, 6)
    assert w[:2].tolist() == [1.0, 1.0] and w[6:].tolist() == [0.0, 0.0]
    c = (6 - torch.arange(2, 6, dtype=torch.float32)) / 5
    assert torch.allclose(w[2:6], c * torch.expm1(c) / np.expm1(1.0))
    assert bool((w[1:] <= w[:-1]).all())
    with pytest.raises(ValueError, match="frozen 3, overlap 2"):
        ChunkGuide(torch.zeros(4, 2), frozen=3, overlap=2)


def test_the_tick_noise_is_a_function_of_seed_and_tick_alone():
    a, b = tick_noise(4, 2, 7, 3), tick_noise(4, 2, 7, 3, torch.Generator(), torch.empty(4, 2))
    assert torch.equal(a, b)
    assert not torch.equal(a, tick_noise(4, 2, 7, 4)) and not torch.equal(a, tick_noise(4, 2, 8, 3))
    config = flow_config()
    chunks = []
    for seed in (0, 0, 1):
        policy = MultiRatePolicy(build_vla(config, seed=3), noise_seed=seed)
        policy.update_text("keep the lane")
        frame, state = next(frames_and_states(1))
        policy.update_vision(policy.prepare_frames([frame]))
        chunks.append(policy.action_tick(state).actions)
    assert np.array_equal(chunks[0], chunks[1]) and not np.array_equal(chunks[0], chunks[2])


def test_a_flow_tick_stopped_between_denoising_steps_commits_nothing():
    policy = MultiRatePolicy(build_vla(flow_config(), seed=3), CacheConfig.exact())
    policy.update_text("keep the lane")
    frame, state = next(frames_and_states(1))
    policy.update_vision(policy.prepare_frames([frame]))
    before = policy.action.valid.clone(), policy.state_count
    seen = []  # two checks in the state's decoder pass (one per layer), then one per denoising step
    with pytest.raises(StageAborted, match="before denoising step 2"):
        policy.action_tick(state, check=lambda f: seen.append(f) or len(seen) < 5)
    assert seen == sorted(seen) and torch.equal(policy.action.valid, before[0]) and policy.state_count == before[1]
    assert policy.action_tick(state).actions.shape == (4, 2)


def test_the_bins_head_refuses_denoising_steps():
    policy = MultiRatePolicy(build_vla(preset("tiny"), seed=3))
    policy.update_text("keep the lane")
    with pytest.raises(ValueError, match="this model's head is bins"):
        policy.action_tick(np.zeros(4), steps=5)


def test_a_flow_models_trunk_is_the_bins_models_of_the_same_seed():
    bins, flow = build_vla(preset("tiny"), seed=4), build_vla(flow_config(), seed=4)
    for name, tensor in bins.state_dict().items():
        assert torch.equal(tensor, flow.state_dict()[name]), name


@pytest.mark.parametrize("state", ["prefix", "suffix"])
def test_a_flow_checkpoint_round_trips_with_its_expert_folder(tmp_path, state):
    model = build_vla(flow_config(state), seed=6)
    path = save_checkpoint(model, tmp_path / "ckpt")
    assert (path / "expert" / "model.safetensors").is_file()
    loaded = load_checkpoint(path)
    assert loaded.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    (path / "expert" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing expert/model.safetensors"):
        load_checkpoint(path)


def test_a_bins_checkpoint_has_no_expert_folder(tmp_path):
    path = save_checkpoint(build_vla(preset("tiny"), seed=6), tmp_path / "ckpt")
    assert not (path / "expert").exists()


def test_the_launch_files_action_head_picks_the_presets_head_and_must_agree_with_a_checkpoint(tmp_path):
    from vla_node.config import load_launch
    from vla_node.validate import ConfigError

    launch = tmp_path / "flow.toml"
    launch.write_text('[model]\npreset = "tiny"\naction_head = "flow"\ninstruction = "keep lane"\n')
    assert load_launch(launch).model.model_config().action_head == "flow"
    bins = save_checkpoint(build_vla(preset("tiny"), seed=0), tmp_path / "bins")
    launch.write_text(f'[model]\ncheckpoint = "{bins}"\naction_head = "flow"\ninstruction = "keep lane"\n')
    with pytest.raises(ConfigError, match="model.action_head = 'flow': expected 'bins' \\(the head of checkpoint"):
        load_launch(launch).model.model_config()
    launch.write_text('[model]\npreset = "tiny"\naction_head = "diffusion"\n')
    with pytest.raises(ConfigError, match="model.action_head = 'diffusion'"):
        load_launch(launch)


def test_vla_node_init_writes_a_flow_checkpoint(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "vla_node.cli", "init", "--preset", "tiny", "--action-head", "flow",
                          "--out", str(tmp_path / "ckpt")], capture_output=True, text=True, check=True).stdout
    assert "flow head" in out and "action expert" in out
    assert load_checkpoint(tmp_path / "ckpt").config.action_head == "flow"


def test_the_expert_keeps_differentiable_linear_layers_whatever_the_weight_format():
    """Guidance backpropagates through the expert; fbgemm's fp16 kernel has no backward (autograd would silently
    drop its gradient), so load_model converts the trunk only, and a policy refuses to guide a converted expert."""
    from vla_node.backends.fp16_weights import Fp16WeightLinear, fp16_weights_available, use_fp16_weights
    from vla_node.backends.loading import load_model

    if not fp16_weights_available():
        pytest.skip("fp16 weights need torch's fbgemm backend (x86-64)")
    model = load_model(flow_config(), "fp16")
    assert isinstance(model.decoder.model.layers[0].mlp.up_proj, Fp16WeightLinear)
    assert all(type(m) is torch.nn.Linear for m in model.expert.modules() if "Linear" in type(m).__name__)
    frame, state = next(frames_and_states(1))
    policy = MultiRatePolicy(model)
    policy.update_text("keep the lane")
    policy.update_vision(policy.prepare_frames([frame]))
    first = policy.action_tick(state)
    guide = ChunkGuide(torch.from_numpy(first.actions), frozen=1, overlap=3)
    assert np.array_equal(policy.action_tick(state, guide=guide).actions[:1], first.actions[:1])
    use_fp16_weights(model.expert)
    converted = MultiRatePolicy(model)
    converted.update_text("keep the lane")
    with pytest.raises(ValueError, match="plain linear layers .* got \\['Fp16WeightLinear'\\]"):
        converted.action_tick(state, guide=guide)


@pytest.mark.parametrize("state", ["prefix", "suffix"])
def test_a_guide_of_zero_weight_leaves_the_tick_as_it_is_over_the_default_storage(state):
    """The guided path attends over its own dense copy of the context; with every weight 0 (no overlap) its
    velocity is the plain one, so the chunk equals the unguided tick's. Over the default cache (bf16 text, INT8
    vision: partitions read through conversion buffers layer by layer) this checks that copy layer by layer."""
    config = flow_config(state)
    frame, state_vector = next(frames_and_states(1))
    chunks = []
    for guide in (None, ChunkGuide(torch.zeros(4, 2), frozen=0, overlap=0)):
        policy = MultiRatePolicy(build_vla(config, seed=3), CacheConfig())
        policy.update_text("keep the lane")
        policy.update_vision(policy.prepare_frames([frame]))
        policy.action_tick(state_vector)  # a stored state in the ring (prefix)
        chunks.append(policy.action_tick(state_vector, guide=guide).actions)
    assert np.abs(chunks[0] - chunks[1]).max() <= 1e-5


def test_a_smaller_noise_scale_is_drawn_alike_by_the_cached_tick_and_the_reference():
    """flow_noise_scale 0.1 (a model trained on small actions): the same noise, scaled, on both paths; and the
    integration starts from a tenth of the unit noise."""
    ours, theirs = run_both(flow_config(flow_noise_scale=0.1), CacheConfig.exact(), steps=1, frames=3)
    assert max_diff(ours, theirs) <= 1e-4
    unit = tick_noise(4, 2, 0, 5)
    assert torch.equal(tick_noise(4, 2, 0, 5, scale=0.1), unit * 0.1)
    with pytest.raises(ConfigError, match="model.flow_noise_scale = 0.0"):
        flow_config(flow_noise_scale=0.0)
