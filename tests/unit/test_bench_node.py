"""`vla-node bench node --preset P`: the launch file it runs (the node itself is measured, not tested, there), and
the control grid recovered from tick stamps."""

import numpy as np
import pytest

from vla_node.bench.node import control_grid, launch_for
from vla_node.config import default_launch, load_launch
from vla_node.validate import ConfigError


def test_the_default_preset_runs_cpu_toml_itself(tmp_path):
    assert launch_for(load_launch(default_launch()).model.preset, tmp_path) == default_launch()


def test_another_preset_gets_a_copy_whose_instruction_fits_it(tmp_path):
    config = load_launch(launch_for("tiny", tmp_path))
    full = load_launch(default_launch()).model.instruction
    assert config.model.preset == "tiny"
    assert full.startswith(config.model.instruction) and len(config.model.instruction.encode()) == 23


def test_a_bad_preset_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"model.preset = 'smal'.*did you mean 'small'"):
        launch_for("smal", tmp_path)


def brute_force_origin(stamps, period, resolution=20_000, refine=500_000) -> int:
    """control_grid's origin by its definition: every candidate phase's mean lateness, as a (C, N) matrix."""
    offsets = (stamps - stamps[0]) % period  # (N,)
    candidates = np.arange(0, period, resolution, dtype=np.int64)  # (C,)
    best = int(candidates[np.argmin(((offsets[None, :] - candidates[:, None]) % period).mean(axis=1))])
    before = (best - offsets) % period
    return int(stamps[0]) + best - int(before[before <= refine].max(initial=0))


def test_the_grid_origin_is_the_phase_of_least_mean_lateness():
    rng = np.random.default_rng(0)
    period = 20_000_000
    for _ in range(20):
        n = int(rng.integers(50, 400))
        index = np.cumsum(rng.choice([1, 1, 1, 1, 2], size=n))  # a few skipped ticks
        late = rng.exponential(300_000, size=n).astype(np.int64).clip(0, period - 1)
        stamps = 10**12 + int(rng.integers(0, period)) + index * period + late
        origin, ticks, lateness = control_grid(stamps, period)
        assert origin == brute_force_origin(stamps, period)
        assert (lateness >= 0).all() and (lateness < period).all() and (np.diff(ticks) >= 1).all()
