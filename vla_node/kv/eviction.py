"""Pure decisions for the vision memory: slot metadata in, slots to evict / merges out. No storage here.

Conventions: metadata tensors are per slot of one partition ([C]); a decision returns a bool mask [C]
(True = evict) unless said otherwise. Frame ids increase with time; `history` is the list of admitted frame
ids inside the window, oldest first, the incoming frame last. Ties in importance go to the older frame,
then to the lower slot, so every decision is deterministic.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from vla_node.kv.vision_config import quota_for_age


def window_evictions(valid: torch.Tensor, frame_id: torch.Tensor, oldest_kept: int) -> torch.Tensor:
    """Slots of frames older than `oldest_kept` (the oldest frame id still inside the window)."""
    return valid & (frame_id < oldest_kept)


def _rank_lowest_first(candidates: torch.Tensor, importance: torch.Tensor, frame_id: torch.Tensor) -> torch.Tensor:
    """Slot ids of the candidates ordered by (importance, frame_id, slot) ascending."""
    slots = torch.nonzero(candidates).flatten()
    by_frame = torch.sort(frame_id[slots], stable=True).indices
    slots = slots[by_frame]
    by_importance = torch.sort(importance[slots], stable=True).indices
    return slots[by_importance]


def lowest_importance(
    candidates: torch.Tensor, importance: torch.Tensor, frame_id: torch.Tensor, n: int
) -> torch.Tensor:
    """The n candidates with the lowest importance (ties: older frame, then lower slot) as a mask [C]."""
    evict = torch.zeros_like(candidates)
    if n > 0:
        evict[_rank_lowest_first(candidates, importance, frame_id)[:n]] = True
    return evict


def oldest_first(candidates: torch.Tensor, importance: torch.Tensor, frame_id: torch.Tensor, n: int) -> torch.Tensor:
    """The n candidates of the oldest frames (ties: lower importance, then lower slot) as a mask [C]."""
    evict = torch.zeros_like(candidates)
    if n > 0:
        slots = _rank_lowest_first(candidates, importance, frame_id)  # (importance, frame, slot)
        by_frame = torch.sort(frame_id[slots], stable=True).indices  # -> (frame, importance, slot)
        evict[slots[by_frame][:n]] = True
    return evict


def quota_evictions(
    valid: torch.Tensor,
    frame_id: torch.Tensor,
    importance: torch.Tensor,
    history: Sequence[int],
    tokens_per_frame: int,
    decay: float,
    minimum: int,
) -> torch.Tensor:
    """PackCache: after admitting the last frame of `history`, each older frame of age a keeps its
    quota_for_age(a) most important tokens; frames outside the history lose everything."""
    evict = valid & (frame_id < history[0])
    for age, fid in enumerate(reversed(history[:-1]), start=1):
        members = valid & (frame_id == fid)
        excess = int(members.sum()) - quota_for_age(age, tokens_per_frame, decay, minimum)
        if excess > 0:
            evict |= lowest_importance(members, importance, frame_id, excess)
    return evict


def h2o_evictions(
    valid: torch.Tensor,
    frame_id: torch.Tensor,
    importance: torch.Tensor,
    needed_free: int,
    protected_from: int,
) -> torch.Tensor:
    """Heavy-hitter retention: free `needed_free` slots by evicting the lowest-importance tokens, sparing
    frames with id >= protected_from (the recent window) unless the others do not suffice."""
    deficit = needed_free - int((~valid).sum())
    if deficit <= 0:
        return torch.zeros_like(valid)
    old = valid & (frame_id < protected_from)
    evict = lowest_importance(old, importance, frame_id, deficit)
    short = deficit - int(evict.sum())
    if short > 0:
        evict |= lowest_importance(valid & ~evict, importance, frame_id, short)
    return evict


def tier_demotions(valid: torch.Tensor, importance: torch.Tensor, frame_id: torch.Tensor, needed_free: int) -> torch.Tensor:
    """Hot-tier tokens to demote to the cold tier so that `needed_free` hot slots are free: the least
    important ones."""
    deficit = needed_free - int((~valid).sum())
    return lowest_importance(valid, importance, frame_id, max(deficit, 0))


def key_cosine(new_k: torch.Tensor, old_k: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Cosine similarity of keys averaged over heads: new_k [H, n, D], old_k [H, C, D] -> [n, C] fp32.
    With `out` the result is added into it (to average over layers)."""
    a = torch.nn.functional.normalize(new_k.float(), dim=-1, eps=1e-12)  # [H, n, D]
    b = torch.nn.functional.normalize(old_k.float(), dim=-1, eps=1e-12)  # [H, C, D]
    sim = torch.bmm(a, b.transpose(1, 2)).mean(dim=0)  # [n, C]
    if out is None:
        return sim
    return out.add_(sim)


class MergePlan(NamedTuple):
    """For each new token: merged (bool[n]) into target (int64[n], meaningful where merged) and its
    similarity (fp32[n], -inf when nothing was comparable)."""

    merged: torch.Tensor
    target: torch.Tensor
    similarity: torch.Tensor


def plan_merges(similarity: torch.Tensor, old_valid: torch.Tensor, threshold: float) -> MergePlan:
    """Each new token merges into its most similar valid old slot when the similarity exceeds `threshold`.
    similarity [n, C] (new tokens x slots), old_valid bool[C]."""
    masked = similarity.masked_fill(~old_valid[None, :], float("-inf"))  # [n, C]
    n, dev = masked.shape[0], masked.device
    if masked.shape[1] == 0:
        best = torch.full((n,), float("-inf"), device=dev)
        target = torch.zeros(n, dtype=torch.int64, device=dev)
    else:
        best, target = masked.max(dim=1)
    return MergePlan(best > threshold, target, best)


def merged_average(
    old_k: torch.Tensor,
    old_count: torch.Tensor,
    new_k: torch.Tensor,
    group: torch.Tensor,
) -> torch.Tensor:
    """Count-weighted average: old_k [L, H, m, D] with counts old_count [m]; new members new_k [L, H, n, D]
    each belonging to group[n] in [0, m) with weight 1. Returns [L, H, m, D] fp32."""
    m = old_k.shape[2]
    total = old_k.float() * old_count.float()[None, None, :, None]  # [L, H, m, D]
    total.index_add_(2, group, new_k.float())
    members = old_count.float() + torch.bincount(group, minlength=m).float()  # [m]
    return total / members[None, None, :, None]
