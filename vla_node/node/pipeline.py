"""The inference worker's per-frame work: plan against the deadline, run the stages, offer the chunk.

No sockets and no threads here: `Pipeline.process(frames, now)` is called by the node's worker thread (and
by tests and benchmarks) with the frames ingest selected; the clock is injected.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from vla_node.config import NodeConfig, node_features
from vla_node.node.chunking import RealTimeChunking
from vla_node.node.faults import with_faults
from vla_node.node.policies import BackendChoice, build_policies
from vla_node.node.warmup import warm_up
from vla_node.runtime.policy import MultiRatePolicy, StageAborted
from vla_node.runtime.reuse import ReuseGate
from vla_node.sched.scheduler import FramePlan, Scheduler
from vla_node.validate import ConfigError
from vla_node.wire.protocol import Frame


class Pipeline:
    """The policies, reuse gates, scheduler and chunk broker of one node, warmed up and ready when constructed
    (`priors`: what the warm-up measured, the scheduler's first cost estimates)."""

    def __init__(self, config: NodeConfig, clock: Callable[[], int] = time.monotonic_ns,
                 warm_up_rounds: int = 2, backend: BackendChoice | None = None, launch: str | None = None,
                 broker=None) -> None:
        self.config = config
        self.clock = clock
        device = config.model.device
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"model.device = {device!r}: CUDA is not available to torch {torch.__version__} "
                              "on this machine; use 'cpu'")
        policy, small, self.backend = build_policies(config, backend, launch)
        c = policy.config
        self.state = np.zeros(c.state_dim, np.float32)
        # A GPU runs the stages asynchronously: wait for it at every budget check and stage end, so that stage
        # costs and checks see the work done, not the work queued.
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        policies = {"": policy} if small is None else {"": policy, "small_": small}
        self.flow = c.action_head == "flow"
        self.priors = warm_up(policies, config.model.instruction, self.state, self.sync, warm_up_rounds,
                              denoising_steps=config.scheduler.denoising_steps if self.flow else (),
                              guided=self.flow and config.scheduler.real_time_chunking)
        self.policy = with_faults(policy, clock)
        self.small = None if small is None else with_faults(small, clock)
        self.instruction = config.model.instruction  # what every policy's text partition holds after the warm-up
        self.gates = [ReuseGate(config.reuse, c.image_size, c.patch_size) for _ in config.cameras]
        # where chunks go: the node's publisher (its link), else a chunk broker of its own (tests, benchmarks)
        self.broker = broker if broker is not None else config.scheduler.broker(c.action_horizon, c.action_dims)
        self.scheduler = Scheduler(config.scheduler, prior_ms=self.priors, features=node_features(c, small is not None),
                                   flow_steps=c.flow_steps if self.flow else None)
        sched_config = config.scheduler
        self.chunking = RealTimeChunking(c.action_horizon, c.action_dims, sched_config.period_ns) \
            if self.flow and sched_config.real_time_chunking else None
        self._origin_ns: int | None = None  # the last tick's chunk: the time its step 0 is for (chunking)
        self.frames_processed = 0
        self.frames_skipped = 0  # planned stale, at a level that runs no inference, or with a dead camera's view
        # A camera whose newest frame was captured longer ago than this is dead (health's camera timeout): no
        # decision is made on its last view; the chunk is withdrawn (the fallback level) until it is back.
        self.view_max_age_ns = int(config.health.camera_timeout_ms * 1e6)
        self.fallback_level = next((level.index for level in self.scheduler.levels if level.knobs.force_fallback),
                                   self.scheduler.top_level)
        self.frames_stale_view = 0  # frames not run because another camera's view was older than view_max_age_ns

    # --- one frame ------------------------------------------------------------------------------------
    def process(self, frames: list[Frame], instruction: str | None, state: np.ndarray | None) -> FramePlan | None:
        """Plan and run the stages for the newest frames (the primary camera's first); offers the chunk to the broker
        when one is made. None, with the chunk withdrawn, when another camera's view is too old to act on."""
        sched = self.scheduler
        if state is not None:
            self.state = state
        now = self.clock()
        if self._stale_view(frames, now):
            self._withdraw(self.fallback_level)
            self.frames_stale_view += 1
            self.frames_skipped += 1
            return None
        changed = instruction is not None and instruction != self.instruction
        primary = frames[0]
        plan = sched.plan_frame(now, primary.stamp_ns, changed)
        knobs = plan.knobs
        if knobs.force_fallback:
            self._withdraw(plan.level)
        if plan.stale or not knobs.run_inference:
            self.frames_skipped += 1
            sched.finish_frame(self.clock(), primary.stamp_ns, plan.budget.outcome())
            return plan
        policy = self.small if knobs.use_smaller_engine else self.policy
        budget = plan.budget
        tokens_refreshed, reuse_ratio = None, None

        def run(stage: str, work: Callable[[Callable[[float], bool]], object]) -> object | None:
            if not budget.fits(stage, self.clock()):
                return None
            budget.begin(stage, self.clock())
            done = [0.0]

            def check(fraction: float) -> bool:
                self.sync()
                done[0] = fraction
                return budget.fits(stage, self.clock(), fraction_left=max(0.0, 1.0 - fraction))

            try:
                result = work(check)
                self.sync()
            except StageAborted:
                budget.stop(stage, self.clock(), min(done[0], 0.99))
                return None
            budget.end(stage, self.clock())
            return result

        if plan.run_text:
            run("text", lambda check: policy.update_text(instruction, check))
            if budget.completed("text"):  # else the old instruction stays, and the new one is retried next frame
                self.instruction = instruction
                if self.small is not None and policy is self.policy:
                    self.small.update_text(instruction)
                if policy is self.small:
                    self.policy.update_text(instruction)  # keep the main engine in step
        update = None
        if plan.run_vision:
            update = self._vision(policy, frames, knobs, plan, run)
            if update is not None:
                tokens_refreshed, reuse_ratio = update.tokens_refreshed, update.reuse_ratio
        chunk = None
        if plan.run_action:
            if update is not None and update.chunk is not None:  # the tick ran in the frame's vision pass
                chunk = update.chunk
                budget.done_within("action", "vision")
            else:
                chunk = run("action", lambda check: self._tick(policy, knobs.denoising_steps, budget, check))
        outcome = budget.outcome()
        if chunk is not None:
            timing = outcome.timing_ms()
            timing["total"] = (self.clock() - now) / 1e6
            origin = None
            if self.chunking is not None:
                origin = self._origin_ns
                self.chunking.offered(chunk.actions, origin)
            self.broker.offer(chunk.actions, primary.seq, primary.stamp_ns, self.clock(), plan.level, timing,
                              deadline_ns=plan.deadline_ns, tokens_refreshed=tokens_refreshed,
                              reuse_ratio=reuse_ratio, origin_ns=origin, denoising_steps=chunk.denoising_steps)
        self.frames_processed += 1
        sched.finish_frame(self.clock(), primary.stamp_ns, outcome)
        if update is not None and update.chunk is not None and sched.wants_action_sample(plan, self.clock()):
            self._sample_action(policy, plan)
        return plan

    def _sample_action(self, policy: MultiRatePolicy, plan: FramePlan) -> None:
        """The action stage timed on its own, after its frame's chunk (decoded in the vision pass) was offered, so
        that measuring it never delays a fresh action: the same tick again, committing nothing."""
        start = self.clock()
        policy.action_tick(self.state, commit=False)
        self.sync()
        end = self.clock()
        self.scheduler.record_sample(plan, "action", end - start, end)

    def _tick(self, policy: MultiRatePolicy, steps: int | None, budget, check):
        """The action stage. Flow head: `steps` Euler steps (the level's; None: the model's), and with real-time
        chunking the guide toward the chunk being played, the chunk's steps counted from this stage's start."""
        if not self.flow:
            return policy.action_tick(self.state, check)
        start = self.clock()
        guide = None if self.chunking is None else self.chunking.guide(start, budget.estimate("action"))
        chunk = policy.action_tick(self.state, check, steps=steps, guide=guide)
        self._origin_ns = start
        return chunk

    def _withdraw(self, level: int) -> None:
        self.broker.withdraw(level)
        if self.chunking is not None:
            self.chunking.withdrawn()

    def _stale_view(self, frames: list[Frame], now: int) -> bool:
        """Whether a camera other than the primary (whose new frame is the reason to run) last sent a frame captured
        more than view_max_age_ns ago: a decision on its old view would be presented as fresh."""
        return any(now - frame.stamp_ns > self.view_max_age_ns for frame in frames[1:])

    def _vision(self, policy: MultiRatePolicy, frames: list[Frame], knobs, plan: FramePlan, run):
        """The vision stage: resize to the model input, plan reuse, update; the gates commit with it. When the
        action stage follows, its tick is handed to the update (it decodes it in the frame's pass where it can;
        its budget stays reserved for a stage that stops halfway)."""
        c = policy.config
        state = self.state if plan.run_action else None
        if policy is self.small or plan.instruction_changed:
            # the smaller engine's cache is not kept frame by frame, and a new instruction invalidates
            # every cached vision token: a full refresh either way
            return run("vision", lambda check: policy.update_vision(
                policy.prepare_frames([f.rgb for f in frames]), None, False, check, state))
        threshold = self.config.reuse.threshold * knobs.reuse_threshold_scale
        cap = None
        if knobs.max_refresh_fraction < 1.0:
            cap = max(1, int(c.tokens_per_camera * knobs.max_refresh_fraction))
        if self.config.reuse.max_refresh is not None:
            cap = self.config.reuse.max_refresh if cap is None else min(cap, self.config.reuse.max_refresh)
        staged = []

        def work(check):
            images = policy.prepare_frames([f.rgb for f in frames])  # [C, S, S, 3]
            plans = [gate.plan(images[i], threshold=threshold, max_refresh=cap) for i, gate in enumerate(self.gates)]
            scene_cut = any(p.scene_cut and p.full for p in plans)  # a capped cut refreshes over several frames
            tokens = [None if p.full else torch.tensor(p.refresh) for p in plans]
            update = policy.update_vision(images, tokens, scene_cut, check, state)
            staged.extend(zip(self.gates, plans, images))
            return update

        update = run("vision", work)
        if update is not None:  # the gates move only with the cache
            for gate, reuse_plan, image in staged:
                gate.commit(reuse_plan, image)
        return update
