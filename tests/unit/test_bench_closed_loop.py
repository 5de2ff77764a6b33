"""bench closed-loop's configurations: the reference first, each optimisation alone on top of it, each level held,
the flow head's fewer denoising steps also alone (levels accumulate, so the level alone is its own ladder)."""

from __future__ import annotations

from vla_node.bench.closed_loop import REFERENCE, _inference_levels, settings
from vla_node.config import load_launch, node_levels
from vla_node.drives.closed_loop import SIM_CHECKPOINTS, SIM_LAUNCH
from vla_node.sched.ladder import Knobs


def knobs_of(head: str, setting) -> Knobs:
    config = load_launch(SIM_LAUNCH, (f"model.checkpoint={SIM_CHECKPOINTS / head}",) + setting.overrides)
    return {level.name: level for level in node_levels(config)}[setting.level].knobs


def test_each_head_has_the_reference_first_and_every_optimisation_alone():
    for head in ("bins", "flow"):
        rows = settings(head, _inference_levels(head, SIM_CHECKPOINTS / head), "calib")
        names = [s.name for s in rows]
        assert names[:3] == ["reference", "reference_repeat", "defaults"] and names[-1] == "delay"
        assert rows[0].overrides == REFERENCE
        for name in ("int8_vision_kv", "reuse_t2", "reuse_t8", "engine_ort_int8", "engine_int8_trt"):
            setting = next(s for s in rows if s.name == name)
            assert setting.overrides[: len(REFERENCE)] == REFERENCE and len(setting.overrides) > len(REFERENCE)
        assert ("rtc" in names) == (head == "flow") and any(n.startswith("level: skip_vision") for n in names)


def test_fewer_denoising_steps_alone_changes_only_the_step_count():
    rows = settings("flow", _inference_levels("flow", SIM_CHECKPOINTS / "flow"), "calib")
    alone = [s for s in rows if s.name.startswith("denoising_")]
    assert [s.name for s in alone] == ["denoising_5", "denoising_2"]
    for setting in alone:
        assert knobs_of("flow", setting) == Knobs(denoising_steps=int(setting.name.split("_")[1]))
    held = next(s for s in rows if s.name == "level: fewer_denoising_steps 5")
    accumulated = knobs_of("flow", held)  # the level in the full ladder keeps the cap and threshold before it
    assert accumulated.denoising_steps == 5 and accumulated.max_refresh_fraction < 1.0


def test_int8_weights_are_a_configuration_where_the_int8_kernel_runs():
    from vla_node.backends.packed_weights import int8_weights_available

    rows = settings("bins", _inference_levels("bins", SIM_CHECKPOINTS / "bins"), "calib")
    int8 = [s for s in rows if s.name == "int8_weights"]
    assert len(int8) == int(int8_weights_available())
    for setting in int8:  # the reference with bf16 compute and int8 weights: a launch file that loads
        config = load_launch(SIM_LAUNCH, (f"model.checkpoint={SIM_CHECKPOINTS / 'bins'}",) + setting.overrides)
        assert (config.model.resolved_dtype, config.model.weight_format) == ("bf16", "int8")
        assert config.reuse.threshold == 0
