"""The test-only fault wrapper: off without its environment variable, loud with it, and each injected delay in
its own stage only."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from vla_node.node.faults import DELAY_FILE_ENV, FaultyPolicy, StageDelay, with_faults


class Policy:
    """Records each verb called; update_vision returns an update whose tick ran in the pass when given a state."""

    def __init__(self) -> None:
        self.calls = []
        self.config = "the wrapped policy's"

    def update_text(self, instruction, check=None):
        self.calls.append("text")

    def update_vision(self, images, tokens=None, scene_cut=False, check=None, state=None):
        self.calls.append("vision")
        return SimpleNamespace(chunk=None if state is None else "chunk")

    def action_tick(self, state, check=None):
        self.calls.append("action")


def test_without_the_variable_the_policy_is_not_wrapped():
    policy = Policy()
    assert with_faults(policy, environ={}) is policy


def test_with_the_variable_the_wrapper_says_so_loudly(tmp_path, caplog):
    path = tmp_path / "delay"
    with caplog.at_level(logging.WARNING):
        wrapped = with_faults(Policy(), environ={DELAY_FILE_ENV: str(path)})
    assert isinstance(wrapped, FaultyPolicy) and wrapped.config == "the wrapped policy's"
    assert "TEST-ONLY FAULT INJECTION ENABLED" in caplog.text


def test_each_delay_applies_to_its_stage_and_is_reread_while_running(tmp_path, monkeypatch):
    slept = []
    monkeypatch.setattr("vla_node.node.faults.time.sleep", slept.append)
    now = [0]
    path = tmp_path / "delay"
    path.write_text("vision 30\n")
    policy = Policy()
    wrapped = FaultyPolicy(policy, StageDelay(path, clock=lambda: now[0]))
    wrapped.update_text("go")
    wrapped.action_tick(None)
    assert slept == [] and policy.calls == ["text", "action"]
    wrapped.update_vision(None)
    assert slept == [0.03]
    path.write_text("action 5\n")
    wrapped.update_vision(None, state=[0.0])  # re-read only after 50 ms: still the vision delay
    assert slept == [0.03, 0.03]
    now[0] += 60_000_000
    wrapped.update_vision(None, state=[0.0])  # the tick decoded in the pass suffers the action delay after it
    wrapped.update_vision(None)  # no tick in the pass: no action delay
    assert slept == [0.03, 0.03, 0.005]
    path.write_text("not a delay")
    now[0] += 60_000_000
    wrapped.action_tick(None)  # an unreadable file: no delay
    assert slept == [0.03, 0.03, 0.005]
