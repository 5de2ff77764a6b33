"""`vla-node bench node --preset P`: the launch file it runs (the node itself is measured, not tested, there)."""

import pytest

from vla_node.bench.node import launch_for
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
