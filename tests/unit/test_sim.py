"""The road simulator: road geometry, the bicycle model, the camera, ground truth, the expert, instructions and
metrics. Exact quantities are checked against closed forms; the rendering by where things land on screen."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vla_node.sim.camera import CameraConfig
from vla_node.sim.env import RoadEnv, SimConfig
from vla_node.sim.instructions import KEEP, LEFT, SLOW, goal_for
from vla_node.sim.loop import ExpertPolicy, drive_in_process
from vla_node.sim.metrics import DriveMetrics
from vla_node.sim.road import Road, RoadConfig
from vla_node.sim.scenario import Cue, InstructionGiver
from vla_node.sim.traffic import Vehicle
from vla_node.sim.vehicle import VehicleConfig, VehicleState, check_action, step_vehicle
from vla_node.validate import ConfigError

# -- road ---------------------------------------------------------------------------------------------------


def test_the_road_curves_within_its_bound_with_a_continuous_heading():
    road = Road(RoadConfig(seed=4, length_m=3000, max_curvature=1 / 250))
    assert np.abs(road.curvature).max() <= 1 / 250 + 1e-12
    assert np.abs(road.curvature).max() > 0.5 / 250  # it does bend
    assert np.sign(road.curvature).min() < 0 < np.sign(road.curvature).max()  # both ways
    step = np.hypot(np.diff(road.x), np.diff(road.y))
    assert np.allclose(step, 0.5, atol=1e-4)  # stations are arc length
    assert np.abs(np.diff(road.heading)).max() <= 0.5 / 250 + 1e-12
    x, y, heading = road.pose(0.0)
    assert (float(x), float(y), float(heading)) == pytest.approx((0.0, 0.0, 0.0), abs=1e-9)


@pytest.mark.parametrize("s, d", [(12.3, 0.0), (800.0, -3.6), (1777.7, -8.1), (2500.0, 1.2)])
def test_frenet_inverts_pose(s, d):
    road = Road(RoadConfig(seed=2, lanes=4))
    x, y, _ = road.pose(s, d)
    assert road.frenet(float(x), float(y), s + 7.0) == pytest.approx((s, d), abs=2e-3)


def test_lanes_and_lines():
    road = Road(RoadConfig(lanes=3, lane_width_m=3.5))
    assert road.lane_offset(2) == -7.0 and road.lane_of(-7.4) == 2 and road.lane_of(10.0) == 0
    assert road.boundaries().tolist() == [1.75, -1.75, -5.25, -8.75]
    assert (road.left_edge, road.right_edge) == (1.75, -8.75)
    with pytest.raises(ValueError, match="station 99999.0 m: outside"):
        road.check_station(99999.0)
    with pytest.raises(ConfigError, match=r"road.lanes = 9: expected an integer in 1..6"):
        RoadConfig(lanes=9)


# -- the car ------------------------------------------------------------------------------------------------


def test_a_steady_steer_drives_the_kinematic_circle():
    config = VehicleConfig()
    state = VehicleState(0.0, 0.0, 0.0, 10.0, steer=0.05)
    for _ in range(500):  # 10 s at 50 Hz, wheel held at its angle (command = angle / max)
        state = step_vehicle(config, state, (0.05 / config.max_steer_rad, 0.0), 0.02)
    radius = config.wheelbase_m / math.tan(0.05)  # R = L / tan(delta)
    centre = (0.0, radius)
    assert math.hypot(state.x - centre[0], state.y - centre[1]) == pytest.approx(radius, rel=1e-3)
    assert state.heading == pytest.approx(10.0 * 10.0 / radius, rel=1e-3)  # yaw = v t / R
    assert state.speed == pytest.approx(10.0)


def test_actuators_are_rate_limited_and_the_car_stops_without_reversing():
    config = VehicleConfig()
    state = VehicleState(0.0, 0.0, 0.0, 2.0)
    state = step_vehicle(config, state, (1.0, -1.0), 0.02)
    assert state.steer == pytest.approx(config.steer_rate * 0.02)  # the wheel turns at most steer_rate
    for _ in range(200):
        state = step_vehicle(config, state, (0.0, -1.0), 0.02)
    assert state.speed == 0.0 and state.accel == 0.0
    assert check_action([3.0, -7.0]) == (1.0, -1.0)  # flow values beyond [-1, 1] are clipped
    with pytest.raises(ValueError, match=r"action \[0.0, nan\]: expected 2 finite numbers"):
        check_action([0.0, float("nan")])
    with pytest.raises(ValueError, match="expected 2 finite numbers"):
        check_action([0.0, 0.0, 0.0])


# -- world, camera, truth -----------------------------------------------------------------------------------


def test_the_world_is_deterministic_by_seed():
    a, b = RoadEnv(SimConfig(seed=5)), RoadEnv(SimConfig(seed=5))
    for _ in range(30):
        a.step((0.1, 0.2))
        b.step((0.1, 0.2))
    assert np.array_equal(a.frame(), b.frame())
    assert a.truth() == b.truth()
    assert not np.array_equal(a.frame(), RoadEnv(SimConfig(seed=6)).frame())


def test_the_camera_sees_the_lane_move_the_other_way_when_the_car_moves():
    """A car 1 m right of its lane's centre sees the lane's lines 1 m further left: in the rows that see the road
    20 m ahead, the bright line pixels move left by about focal x 1 m / 20 m."""
    config = SimConfig(seed=3, lanes=3, traffic_per_km=0.0, max_curvature=0.0, palette="overcast")
    centred = RoadEnv(config, ego_lane=1).frame()
    moved = RoadEnv(config, ego_lane=1, offset_m=-1.0).frame()  # d = -1: one metre right
    camera = CameraConfig()
    row = round(camera.horizon * camera.height + camera.focal * camera.height_m / 20.0)

    def line_columns(frame):
        brightness = frame[row].astype(float).mean(axis=1)
        return np.flatnonzero(brightness > np.median(brightness) + 40)

    before, after = line_columns(centred), line_columns(moved)
    assert before.size and after.size
    shift = after.mean() - before.mean()
    expected = -camera.focal * 1.0 / (20.0 - camera.forward_m)
    assert shift == pytest.approx(expected, rel=0.25)


def test_truth_offsets_heading_collision_and_the_road_edge():
    config = SimConfig(seed=1, lanes=2, traffic_per_km=0.0)
    env = RoadEnv(config, ego_lane=1, offset_m=0.4, heading_error=0.03)
    truth = env.truth()
    assert truth.lane == 1 and truth.d == pytest.approx(-3.6 + 0.4, abs=1e-6)
    assert truth.heading_error == pytest.approx(0.03, abs=1e-9)
    assert (truth.lane_left, truth.lane_right) == pytest.approx((-1.8, -5.4))
    assert not truth.collision and not truth.off_road and truth.lead_gap_m > 50
    ahead = Vehicle(lane=1, s0=env.body_station() + 10.0, speed=0.0, length_m=4.5, width_m=1.8, height_m=1.5,
                    colour=np.zeros(3, np.float32), sway_m=0.0, sway_period_s=5.0, sway_phase=0.0)
    env.traffic = [ahead]
    assert env.truth().lead_gap_m == pytest.approx(10.0 - 4.5 / 2 - config.vehicle.length_m / 2, abs=1e-6)
    env.traffic = [dataclasses_replace(ahead, s0=env.body_station() + 1.0)]
    assert env.truth().collision
    edge = RoadEnv(config, ego_lane=1, offset_m=-1.0)  # 1 m right of lane 1: its right side past the edge
    assert edge.truth().off_road and not edge.truth().left_road


def dataclasses_replace(vehicle: Vehicle, **changes) -> Vehicle:
    import dataclasses

    return dataclasses.replace(vehicle, **changes)


def test_the_state_message_holds_what_the_car_knows():
    env = RoadEnv(SimConfig(seed=0), speed=10.0)
    state = env.state_vector()
    assert state.dtype == np.float32 and state.shape == (4,)
    assert state[0] == pytest.approx(0.5)  # 10 m/s on the 20 m/s scale
    assert np.all(state[1:] == 0)


# -- instructions, the giver, the expert ----------------------------------------------------------------------


def test_goals_and_the_lane_change_that_has_no_lane():
    assert goal_for(LEFT, 2, 1.0, 20.0, 10.0).lane == 1
    assert goal_for(SLOW, 2, 1.0, 20.0, 10.0).speed == 10.0
    with pytest.raises(ValueError, match="no lane to the left"):
        goal_for(LEFT, 0, 0.0, 20.0, 10.0)
    with pytest.raises(ValueError, match="instruction 'turn around'"):
        goal_for("turn around", 1, 0.0, 20.0, 10.0)


def test_the_expert_keeps_its_lane_changes_left_and_slows_down():
    """The expert as the loop's policy: the check that the world, the giver and the metrics agree with a driver who
    knows the truth (and the speed at which this loop renders)."""
    config = SimConfig(seed=2, lanes=3)
    env = RoadEnv(config, ego_lane=2, offset_m=0.6, seconds=48)
    giver = InstructionGiver(config, env.road, (Cue(0.0, KEEP), Cue(12.0, LEFT), Cue(24.0, SLOW), Cue(40.0, KEEP)))
    result = drive_in_process(env, giver, ExpertPolicy(env, giver, horizon=4), 48.0)
    s = result.summary
    assert s["lateral_error_mean_m"] < 0.08 and s["lane_departures"] == 0 and s["collisions"] == 0
    assert s["instruction_success"] == 1.0, s["instructions"]
    assert [r["instruction"] for r in s["instructions"]] == [KEEP, LEFT, KEEP, SLOW, KEEP]
    change = s["instructions"][1]
    assert change["lane"] == 1 and 1.5 < change["arrived_s"] < 5.0  # gentle: a few seconds
    assert s["instructions"][3]["speed_error_mps"] < 1.0
    assert env.truth().lane == 1


def test_a_lane_change_is_skipped_in_the_leftmost_lane_and_times_out():
    config = SimConfig(seed=2, lanes=2)
    env = RoadEnv(config, ego_lane=0)
    giver = InstructionGiver(config, env.road, (Cue(0.0, KEEP), Cue(1.0, LEFT)))
    for _ in range(100):
        giver.update(env.truth())
        env.step((0.0, 0.0))
    assert giver.skipped == [Cue(1.0, LEFT)] and [i.instruction for i in giver.issued] == [KEEP]
    env = RoadEnv(config, ego_lane=1)
    giver = InstructionGiver(config, env.road, (Cue(0.0, LEFT),), change_timeout_s=1.0)
    for _ in range(60):  # the car goes straight: never arrives
        giver.update(env.truth())
        env.step((0.0, 0.0))
    assert [i.instruction for i in giver.issued] == [LEFT, KEEP] and giver.issued[0].arrived_s is None


# -- metrics ------------------------------------------------------------------------------------------------


def _truth(env: RoadEnv, d: float, speed: float = 20.0, collision: bool = False):
    import dataclasses

    return dataclasses.replace(env.truth(), d=d, lane=env.road.lane_of(d), speed=speed, collision=collision, t=env.t)


def test_departures_count_once_per_excursion_and_by_speed():
    config = SimConfig(seed=0, lanes=2)
    env = RoadEnv(config, ego_lane=1)
    giver = InstructionGiver(config, env.road, (Cue(0.0, KEEP),))
    giver.update(env.truth())
    metrics = DriveMetrics(config, env.road)
    centre = env.road.lane_offset(1)
    edge = 1.8 - 0.9  # the body's half width inside a 3.6 m lane
    for d, speed, collision in [(0.0, 20, False), (0.5, 20, False), (edge + 0.1, 20, False), (edge + 0.3, 20, True),
                                (0.2, 20, True), (0.0, 20, False), (-(edge + 0.2), 2.0, False), (0.0, 1.0, False)]:
        env.t += env.dt
        metrics.record(_truth(env, centre + d, speed, collision), giver, np.zeros(2))
    s = metrics.summary(giver)
    assert s["lane_departures"] == 2 and s["departures_at_speed"] == 1
    assert s["collisions"] == 1
    assert s["lateral_error_max_m"] == pytest.approx(edge + 0.3)
    assert s["instruction_success"] == 0.0  # the keep had departures


def test_a_drive_that_starts_with_an_impossible_lane_change_keeps_the_lane():
    config = SimConfig(seed=2, lanes=2)
    env = RoadEnv(config, ego_lane=0)
    giver = InstructionGiver(config, env.road, (Cue(0.0, LEFT),))
    assert giver.update(env.truth()) == KEEP and giver.goal.lane == 0 and giver.skipped == [Cue(0.0, LEFT)]


def test_a_lane_change_with_a_departure_is_no_success_and_an_overshoot_counts_against_the_keep():
    config = SimConfig(seed=0, lanes=2)
    for path, change_ok in (((-3.6, -5.0, -2.0, -0.5), False),  # swerves right out of its lane first
                            ((-3.6, -2.0, -0.5, 1.5, 3.0), True)):  # crosses cleanly, then runs off the left edge
        env = RoadEnv(config, ego_lane=1)
        giver = InstructionGiver(config, env.road, (Cue(0.0, LEFT),))
        metrics = DriveMetrics(config, env.road)
        for d in path:
            env.t += env.dt
            truth = _truth(env, d)
            giver.update(truth)
            metrics.record(truth, giver, np.zeros(2))
        rows = metrics.instructions(giver)
        assert rows[0]["instruction"] == LEFT and rows[0]["arrived_s"] is not None
        assert rows[0]["success"] == change_ok
        if change_ok:
            assert rows[1]["instruction"] == KEEP and rows[1]["departures"] == 1 and not rows[1]["success"]
