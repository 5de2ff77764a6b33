"""The trained checkpoints kept with the code (checkpoints/tiny): each is the tiny preset's `vla-node train` run, and
each keeps its lane and changes lane on command in the simulator, in process, where random weights leave the road."""

from __future__ import annotations

import json

import pytest

from vla_node.drives.closed_loop import SIM_CHECKPOINTS
from vla_node.model.checkpoint import load_checkpoint
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.sim.instructions import KEEP, LEFT
from vla_node.sim.scenario import Cue
from vla_node.train.evaluate import evaluate
from vla_node.train.trainer import TrainConfig

HEADS = ("bins", "flow")
LANE_CHANGE = (Cue(0.0, KEEP), Cue(12.0, LEFT))  # on road 2 (two lanes, day): keep, then change to the left lane


@pytest.mark.parametrize("head", HEADS)
def test_a_kept_checkpoint_is_the_presets_finished_run(head):
    state = json.loads((SIM_CHECKPOINTS / head / "train" / "state.json").read_text())
    run = TrainConfig(**state["config"])
    assert run.same_run(TrainConfig.for_preset("tiny", action_head=head)), state["config"]
    assert state["step"] == run.steps
    first_loss, held_out = state["losses"][0][1], state["validation"][-1][1]
    assert held_out < 0.5 * first_loss, (held_out, first_loss)  # on episodes it never trained on
    assert load_checkpoint(SIM_CHECKPOINTS / head).config.action_head == head


@pytest.mark.parametrize("head", HEADS)
def test_a_kept_checkpoint_keeps_its_lane_and_changes_lane_where_random_weights_leave_the_road(head):
    trained = evaluate(load_checkpoint(SIM_CHECKPOINTS / head), seeds=(2,), seconds=24.0, cues=LANE_CHANGE)
    assert trained["lane_departures"] == 0 and trained["collisions"] == 0 and not trained["left_road"], trained
    assert trained["instruction_success"] == 1.0  # kept the lane, changed lane, settled in the new one
    assert trained["lateral_error_mean_m"] < 0.15 and trained["lateral_error_max_m"] < 0.6
    random = evaluate(build_vla(preset("tiny", action_head=head), seed=0), seeds=(2,), seconds=24.0, cues=LANE_CHANGE)
    assert random["left_road"] == 1 and random["drives"][0]["seconds"] < 12.0, random["drives"]
