"""The flow head in the worker's pipeline, on an injected clock: fewer denoising steps as the scheduler's degrade
knob, and real-time chunking's continuity at chunk boundaries, each under an injected delay of the action stage."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from vla_node.config import load_launch
from vla_node.model.checkpoint import save_checkpoint
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.node.pipeline import Pipeline
from vla_node.report.continuity import chunk_continuity
from vla_node.report.report import ActionRecord
from vla_node.sched.broker import TickStatus
from vla_node.wire.protocol import Frame

TINY = Path(__file__).parents[1] / "launch" / "tiny.toml"
MS = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 10**12

    def __call__(self) -> int:
        return self.now


class DelayedTicks:
    """The policy with its action stage taking `ms_per_step` per denoising step (and one more for the state's decoder
    pass) on the injected clock: an injected delay that fewer steps shorten, as they would on a real machine. Every
    guided tick's frozen steps are checked against its target as it returns."""

    def __init__(self, policy, clock: Clock, ms_per_step: float) -> None:
        self.wrapped, self.clock, self.ms_per_step = policy, clock, ms_per_step
        self.frozen_kept: list[bool] = []

    def __getattr__(self, name):
        return getattr(self.wrapped, name)

    def action_tick(self, state, check=None, steps=None, guide=None):
        chunk = self.wrapped.action_tick(state, check, steps=steps, guide=guide)
        if guide is not None:
            self.frozen_kept.append(np.array_equal(chunk.actions[: guide.frozen], guide.target[: guide.frozen].numpy()))
        self.clock.now += int(self.ms_per_step * (chunk.denoising_steps + 1) * MS)
        return chunk


def flow_pipeline(tmp_path, clock, horizon=4, **scheduler):
    path = save_checkpoint(build_vla(preset("tiny", "flow").replace(action_horizon=horizon), seed=2), tmp_path / "m")
    config = load_launch(TINY)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, checkpoint=str(path)),
                                 scheduler=dataclasses.replace(config.scheduler, **scheduler))
    return Pipeline(config, clock, warm_up_rounds=1)


def frame(seq: int, stamp_ns: int) -> Frame:
    rgb = np.full((48, 64, 3), 40, np.uint8)
    rgb[: 8 + seq % 16] = 200  # a band that moves: some patches change
    return Frame("front", seq, stamp_ns, "rgb8", 48, 64, rgb)


def test_a_flow_pipeline_publishes_its_continuous_chunk_with_its_step_count(tmp_path):
    clock = Clock()
    pipeline = flow_pipeline(tmp_path, clock)
    assert [level.name for level in pipeline.scheduler.levels][5:7] == ["fewer_denoising_steps 5",
                                                                        "fewer_denoising_steps 2"]
    pipeline.process([frame(0, clock.now)], None, np.ones(4, np.float32))
    out = pipeline.broker.next(clock.now)
    assert out.status is TickStatus.FRESH and out.denoising_steps == 10 and out.chunk.shape == (4, 2)
    assert not np.array_equal(out.chunk, np.round(out.chunk))  # continuous values, no bin centres


@pytest.mark.parametrize("ms_per_step, settles_at", [(12, 5), (20, 2)])
def test_an_injected_delay_moves_the_flow_tick_to_fewer_denoising_steps(tmp_path, ms_per_step, settles_at):
    """The action deadline is 100 ms. At 12 ms a step the 10-step tick takes 132 ms and 5 steps 72 ms; at 20 ms a
    step 5 steps take 120 ms and 2 steps 60 ms. Once the tick's cost is measured, the scheduler plans the first level
    whose estimate fits: the fewer_denoising_steps level that does, before skip_vision; the vision keeps running."""
    clock = Clock()
    pipeline = flow_pipeline(tmp_path, clock)
    pipeline.policy = DelayedTicks(pipeline.policy, clock, ms_per_step)
    names, steps = [], []
    for seq in range(6):
        plan = pipeline.process([frame(seq, clock.now)], None, np.ones(4, np.float32))
        names.append(plan.level_name)
        steps.append(pipeline.broker.next(clock.now).denoising_steps)
        assert plan.run_vision
        clock.now += 300 * MS
    assert names[0] == "normal" and steps[0] == 10
    assert set(names[2:]) == {f"fewer_denoising_steps {settles_at}"} and set(steps[2:]) == {settles_at}, (names, steps)


def ticks_of(pipeline, clock, frames: int, frame_ms: int) -> list[ActionRecord]:
    """Frames every frame_ms; after each, the control ticks (every 20 ms, 50 Hz) until the next chunk is offered, as
    ActionRecords of what the publisher would play."""
    records, start = [], clock.now
    period = 20 * MS
    for seq in range(frames):
        captured = start + seq * frame_ms * MS
        clock.now = max(clock.now, captured)
        pipeline.process([frame(seq, captured)], None, np.full(4, 0.1 * seq, np.float32))
        offered = clock.now
        until = start + (seq + 1) * frame_ms * MS + (offered - captured)  # the next offer, the same delay later
        tick = -(-offered // period) * period
        while tick < until:
            out = pipeline.broker.next(tick)
            chunk = None if out.chunk is None else tuple(map(tuple, out.chunk.tolist()))
            records.append(ActionRecord(tick, tick, len(records), out.status.value, 0, out.frame_seq,
                                        out.frame_stamp_ns, {}, None, None, None, action=tuple(out.action.tolist()),
                                        chunk=chunk, step=out.step))
            tick += period
    return records


def test_real_time_chunking_keeps_a_new_chunk_close_to_the_one_it_replaces(tmp_path):
    """H = 8 steps of 20 ms; a frame every 40 ms; the tick takes 33 ms (10 steps + the state's pass at 3 ms), so two
    steps are frozen and four more guided. Without chunking a chunk starts at its step 0 when it arrives; with it, at
    the step for its arrival time, its overlap guided toward the chunk it replaces: the deviation from the replaced
    chunk's own action at the boundary tick drops (30 frames: 1.90 -> 0.26), and so does the step the actuators see
    there (1.82 -> 1.18); no tick falls back, and every frozen step is the old chunk's."""
    figures = {}
    for rtc in (False, True):
        clock = Clock()
        pipeline = flow_pipeline(tmp_path / str(rtc), clock, horizon=8, real_time_chunking=rtc)
        pipeline.policy = DelayedTicks(pipeline.policy, clock, 3)
        records = ticks_of(pipeline, clock, frames=10, frame_ms=40)
        assert all(r.status != "fallback" for r in records)
        figures[rtc] = chunk_continuity(records)
        if rtc:
            assert pipeline.chunking.guided >= 8 and pipeline.chunking.frozen_steps == 2 * pipeline.chunking.guided
            assert pipeline.policy.frozen_kept and all(pipeline.policy.frozen_kept)
    off, on = figures[False], figures[True]
    assert off["chunk_boundaries"] >= 8 and on["chunk_boundaries"] >= 8
    assert on["chunk_boundary_deviation"] < 0.5 * off["chunk_boundary_deviation"], figures
    assert on["chunk_boundary_jump"] < off["chunk_boundary_jump"], figures
