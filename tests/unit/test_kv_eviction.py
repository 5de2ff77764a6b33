"""Pure eviction decisions: metadata in, slots out."""

from __future__ import annotations

import pytest
import torch

from helpers.oracles import frame_ages
from vla_node.kv import eviction as ev


def meta(frames, importance):
    frame_id = torch.tensor(frames, dtype=torch.int64)
    return torch.ones(len(frames), dtype=torch.bool), frame_id, torch.tensor(importance, dtype=torch.float32)


def test_quota_decays_with_age_down_to_the_minimum():
    assert [ev.quota_for_age(a, 196, 0.5, 32) for a in range(5)] == [196, 98, 49, 32, 32]
    assert [ev.quota_for_age(a, 10, 1.0, 0) for a in range(3)] == [10, 10, 10]
    assert ev.quota_for_age(3, 16, 0.5, 40) == 16  # the minimum never exceeds a whole frame


def test_window_and_ages():
    valid, frame_id, _ = meta([3, 3, 5, 7, 9], [0] * 5)
    valid[1] = False
    assert ev.window_evictions(valid, frame_id, 7).tolist() == [True, False, True, False, False]
    assert frame_ages(frame_id, [5, 7, 9]).tolist() == [3, 3, 2, 1, 0]


def test_lowest_importance_breaks_ties_by_older_frame_then_slot():
    valid, frame_id, imp = meta([2, 1, 1, 2, 3], [0.5, 0.5, 0.1, 0.5, 0.0])
    assert ev.lowest_importance(valid, imp, frame_id, 3).tolist() == [False, True, True, False, True]
    assert ev.lowest_importance(valid, imp, frame_id, 4).tolist() == [True, True, True, False, True]
    assert ev.oldest_first(valid, imp, frame_id, 3).tolist() == [True, True, True, False, False]
    assert not ev.lowest_importance(valid, imp, frame_id, 0).any()


def test_quota_evictions_keep_the_most_important_tokens_per_age():
    # frames 1, 2, 3 hold 4 tokens each; incoming frame 4; tpf 4, decay 0.5, min 1: quota(1)=2, (2)=1, (3)=1
    frames = [1] * 4 + [2] * 4 + [3] * 4
    imp = [0.1, 0.9, 0.5, 0.2] * 3
    valid, frame_id, importance = meta(frames, imp)
    evict = ev.quota_evictions(valid, frame_id, importance, [1, 2, 3, 4], 4, 0.5, 1)
    keep = (~evict).reshape(3, 4)
    assert keep[2].tolist() == [False, True, True, False]  # age 1: quota 2, the two most important
    assert keep[1].tolist() == [False, True, False, False]  # age 2: quota 1
    assert keep[0].tolist() == [False, True, False, False]  # age 3: quota max(1, floor(0.5))
    evict = ev.quota_evictions(valid, frame_id, importance, [1, 2, 3, 4], 4, 1.0, 1)
    assert not evict.any()  # no decay: every frame keeps everything
    # frames outside the history lose everything
    assert ev.quota_evictions(valid, frame_id, importance, [2, 3, 4], 4, 0.5, 1)[:4].all()


def test_h2o_spares_protected_frames_and_frees_exactly_what_is_needed():
    valid, frame_id, imp = meta([1, 1, 2, 2, 3, 3], [5.0, 0.1, 0.2, 4.0, 0.0, 0.0])
    valid = torch.cat([valid, torch.zeros(2, dtype=torch.bool)])
    frame_id = torch.cat([frame_id, torch.zeros(2, dtype=torch.int64)])
    imp = torch.cat([imp, torch.zeros(2)])
    evict = ev.h2o_evictions(valid, frame_id, imp, needed_free=4, protected_from=3)
    assert evict.tolist() == [False, True, True, False, False, False, False, False]
    assert not ev.h2o_evictions(valid, frame_id, imp, needed_free=2, protected_from=3).any()
    # when the unprotected tokens do not suffice, protected ones go too (lowest first)
    evict = ev.h2o_evictions(valid, frame_id, imp, needed_free=8, protected_from=2)
    assert int(evict.sum()) == 6
    # 2 slots are free, 5 needed: frame 1's two unprotected tokens, then one protected token, the least important
    evict = ev.h2o_evictions(valid, frame_id, imp, needed_free=5, protected_from=2)
    assert evict.tolist() == [True, True, False, False, True, False, False, False]


def test_plan_merges_and_weighted_average():
    sim = torch.tensor([[0.99, 0.2, 0.97], [0.1, 0.3, 0.5], [0.96, 0.98, 0.1]])
    valid = torch.tensor([True, True, False])
    plan = ev.plan_merges(sim, valid, 0.95)
    assert plan.merged.tolist() == [True, False, True] and plan.target[plan.merged].tolist() == [0, 1]
    assert not ev.plan_merges(torch.zeros(2, 0), torch.zeros(0, dtype=torch.bool), 0.5).merged.any()
    old = torch.tensor([1.0, 10.0]).reshape(1, 1, 2, 1)
    new = torch.tensor([4.0, 7.0, 13.0]).reshape(1, 1, 3, 1)
    avg = ev.merged_average(old, torch.tensor([2, 1]), new, torch.tensor([0, 0, 1]))
    assert avg.flatten().tolist() == pytest.approx([(2 * 1 + 4 + 7) / 4, (10 + 13) / 2])


def test_key_cosine_averages_heads():
    a = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # [H=2, n=1, D=2]
    b = torch.tensor([[[2.0, 0.0]], [[1.0, 0.0]]])  # [H=2, C=1, D=2]
    assert ev.key_cosine(a, b).item() == pytest.approx(0.5)
