"""Vision-token reuse gate: which image patches changed enough, since they were last refreshed, to be recomputed.

One `ReuseGate` per camera. It keeps, in a preallocated buffer, the pixels of every patch as they were when that
patch was last refreshed (recomputed by the vision tower). Each frame:

    plan = gate.plan(rgb)        # pure: per-patch drift against the reference, which patches to recompute
    ... recompute the tokens of plan.refresh, keep the cached outputs of the others ...
    gate.commit(plan, rgb)       # only now does the reference move (transactional: an abandoned plan is a no-op)

Drift is the mean absolute pixel difference (0-255 scale, over the P x P x 3 values of a patch) against the
reference, not against the previous frame, so slow changes accumulate until the patch is refreshed.
A patch is refreshed when its drift reaches the threshold (it is reusable while its drift stays under it), so
threshold 0 refreshes everything. A full refresh happens on the first frame, every `full_refresh_every` frames, and
on a scene cut (more than `scene_cut_fraction` of the patches drift past `scene_cut_threshold`). With `max_age`, a
frame that changes also refreshes the ceil(patches / max_age) patches reused longest: a reused token carries
approximations (its sub-threshold drift, the shared-drift corrections of vision_cache.py) that grow with the
changing frames it sat out; a still frame refreshes nothing and ages nothing. A cap on refreshed
tokens (how the deadline scheduler degrades) keeps the most-changed patches first; it applies to forced and scene-cut
refreshes too (the rest follow on later frames, since their drift stays high), but never to the first frame after
construction or reset, when nothing is cached that could be reused.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from vla_node.validate import is_int, is_number, require

# Every state the reference can be in gets a token never used before (across all gates), so that a plan made
# against another state, or by another gate, is refused by commit instead of silently corrupting the reference.
_basis_tokens = itertools.count(1)


def _check_threshold(key: str, value: object) -> None:
    require(is_number(value) and math.isfinite(value) and value >= 0, key, value,
            "a finite mean absolute pixel difference >= 0 on the 0-255 scale (0 refreshes every patch)")


def _check_cap(key: str, value: object, minimum: int) -> None:
    require(value is None or (is_int(value) and value >= minimum), key, value,
            f"None (no cap) or an integer >= {minimum} (tokens refreshed per frame)")


@dataclass(frozen=True)
class ReuseConfig:
    """When a vision patch is recomputed instead of reused."""

    threshold: float = 8.0  # refresh a patch once its mean |pixel - last refreshed pixel| (0-255) reaches this
    full_refresh_every: int = 0  # force a full refresh every N frames; 0 = never
    scene_cut_fraction: float = 0.55  # scene cut when more than this fraction of patches ...
    scene_cut_threshold: float = 24.0  # ... drift past this (0-255); a scene cut refreshes everything
    max_refresh: int | None = None  # cap on refreshed tokens per frame; None = no cap
    # Beyond the pixel gate: per layer, also recompute tokens whose input drifted more than this (relative L2)
    # since they were last recomputed there (Eventful-style), in the vision tower and in the decoder's vision
    # partition. None = off (fastest). Lower = more accurate and slower: ~0.05 gave ~6% logit error at ~1.3x
    # (before shared drift).
    tower_drift_threshold: float | None = None
    decoder_drift_threshold: float | None = None
    # Per layer, recompute this many times the gate's tokens (Eventful Transformers' top-k): the gate's plus the
    # most drifted others, in the tower and the decoder's vision partition. None = off. Measured before shared
    # drift, on the freeway clip at 10 fps, threshold 8: 1.5 gave 6.8% logit error at 1.66x (off: 11.1% at 2.06x;
    # drift thresholds 0.05: 6.7% at 1.4x).
    layer_budget: float | None = None
    # Shared drift: per layer, every reused token's cached parts (tower Q/K/V, attention and MLP updates; the
    # decoder's attention and MLP updates) move by the mean change measured on this many evenly spaced reused tokens,
    # recomputed for it; reused tokens then skip their attention too. 0 = off (reused tokens recompute their
    # attention instead). Most of what a reused token misses is shared: its neighbours changed, not itself.
    shared_drift_samples: int = 8
    # Each frame that changes, also refresh the ceil(patches / max_age) patches reused longest, so that no token
    # carries corrections (or sub-threshold drift) for more than about max_age changing frames. 0 = off.
    max_age: int = 20

    def __post_init__(self) -> None:
        _check_threshold("reuse.threshold", self.threshold)
        require(is_int(self.full_refresh_every) and self.full_refresh_every >= 0, "reuse.full_refresh_every",
                self.full_refresh_every, "an integer >= 0 (frames between forced full refreshes; 0 = never)")
        require(is_number(self.scene_cut_fraction) and 0.0 <= self.scene_cut_fraction <= 1.0,
                "reuse.scene_cut_fraction", self.scene_cut_fraction,
                "a fraction of patches in [0, 1] (1 = never a scene cut)")
        require(is_number(self.scene_cut_threshold) and math.isfinite(self.scene_cut_threshold)
                and 0.0 < self.scene_cut_threshold <= 255.0, "reuse.scene_cut_threshold", self.scene_cut_threshold,
                "a mean absolute pixel difference in (0, 255]")
        _check_cap("reuse.max_refresh", self.max_refresh, 1)
        require(self.layer_budget is None or (is_number(self.layer_budget) and math.isfinite(self.layer_budget)
                                              and self.layer_budget >= 1.0), "reuse.layer_budget", self.layer_budget,
                "unset (off) or a multiple >= 1 of the gate's tokens, recomputed per layer, e.g. 1.5")
        require(is_int(self.shared_drift_samples) and self.shared_drift_samples >= 0, "reuse.shared_drift_samples",
                self.shared_drift_samples, "an integer >= 0 (reused tokens sampled per layer; 0 = off)")
        require(is_int(self.max_age) and self.max_age >= 0, "reuse.max_age", self.max_age,
                "an integer >= 0 (changing frames a patch may be reused before it is refreshed; 0 = off)")
        for key in ("tower_drift_threshold", "decoder_drift_threshold"):
            value = getattr(self, key)
            require(value is None or (is_number(value) and math.isfinite(value) and value > 0), f"reuse.{key}",
                    value, "unset (off) or a relative drift > 0, e.g. 0.05")


@dataclass(frozen=True, eq=False)
class ReusePlan:
    """The decision for one frame of one camera. Immutable; `commit` it to the gate that made it, or drop it."""

    refresh: np.ndarray  # int64[k] patch indices (row-major over the patch grid) to recompute, most-changed first
    drift: np.ndarray  # float32[num_patches] mean abs pixel diff vs the reference; inf on the first frame
    full: bool  # every patch is refreshed
    forced: bool  # first frame since construction/reset, or the periodic full refresh is due
    scene_cut: bool  # more than scene_cut_fraction of the patches drifted past scene_cut_threshold
    reuse_ratio: float  # 1 - refreshed / num_patches
    threshold: float  # the threshold this plan used (config or override)
    max_refresh: int | None  # the cap this plan used (config or override)
    basis: int  # token of the gate state the plan was made against (checked by commit)

    @property
    def num_patches(self) -> int:
        return int(self.drift.size)


class ReuseGate:
    """Per-camera change detector over a P x P patch grid of a fixed-size RGB image (uint8, already resized)."""

    def __init__(self, config: ReuseConfig, image_size: int | tuple[int, int] = 224, patch_size: int = 16) -> None:
        require(isinstance(config, ReuseConfig), "config", config, "a ReuseConfig")
        if is_int(image_size):
            image_size = (int(image_size), int(image_size))
        require(isinstance(image_size, tuple) and len(image_size) == 2 and all(is_int(s) and s > 0 for s in image_size),
                "image_size", image_size, "a positive integer or a (height, width) pair of them")
        require(is_int(patch_size) and patch_size > 0, "patch_size", patch_size, "a positive integer (pixels)")
        height, width = (int(s) for s in image_size)
        patch = int(patch_size)
        require(height % patch == 0 and width % patch == 0, "image_size", image_size,
                f"height and width divisible by patch_size = {patch}")
        self.config = config
        self.image_shape = (height, width, 3)
        self.patch_size = patch
        self.grid = (height // patch, width // patch)  # (rows, cols) of patches
        self.num_patches = self.grid[0] * self.grid[1]
        self._pixels_per_patch = patch * patch * 3
        # Preallocated state and scratch: nothing of image size is allocated per frame.
        self._reference = np.zeros(self.image_shape, np.uint8)  # pixels of each patch as last refreshed
        self._diff = np.empty(self.image_shape, np.int16)  # |frame - reference|
        # Sum over a patch's P rows first (contiguous slabs: fast), then over its P*3 columns. A column sum is at
        # most P * 255, which fits int16 for P <= 128.
        column_dtype = np.int16 if patch * 255 <= np.iinfo(np.int16).max else np.int32
        self._column_sums = np.empty((self.grid[0], width * 3), column_dtype)  # (rows, W*3)
        self._patch_sums = np.empty(self.grid, np.int64)  # (rows, cols): sum of _diff per patch
        self._has_reference = False
        self._frames_since_full = 0
        self._age = np.zeros(self.num_patches, np.int64)  # changing frames each patch has been reused since refreshed
        self._basis = next(_basis_tokens)

    # ------------------------------------------------------------------ state, read-only

    @property
    def has_reference(self) -> bool:
        return self._has_reference

    @property
    def frames_since_full(self) -> int:
        """Frames committed since the last committed full refresh."""
        return self._frames_since_full

    @property
    def reference(self) -> np.ndarray:
        """Read-only view of the reference image (uint8[H, W, 3])."""
        view = self._reference.view()
        view.flags.writeable = False
        return view

    # ------------------------------------------------------------------ the verbs

    def plan(self, rgb: np.ndarray, threshold: float | None = None, max_refresh: int | None = None) -> ReusePlan:
        """Decide which patches of `rgb` to recompute. Does not change the gate's state.

        `threshold` and `max_refresh` override the config for this frame (None keeps the config's value).
        The cap does not apply to the first frame after construction or reset (nothing cached to reuse)."""
        self._check_frame(rgb)
        config = self.config
        if threshold is None:
            threshold = config.threshold
        else:
            _check_threshold("threshold", threshold)
        if max_refresh is None:
            max_refresh = config.max_refresh
        else:
            _check_cap("max_refresh", max_refresh, 0)
        total = self.num_patches

        if not self._has_reference:
            drift = np.full(total, np.inf, np.float32)
            refresh = np.arange(total, dtype=np.int64)
            return ReusePlan(refresh, drift, True, True, False, 0.0, float(threshold), max_refresh, self._basis)

        drift = self._drift(rgb)  # float32[num_patches]
        scene_cut = np.count_nonzero(drift > config.scene_cut_threshold) > config.scene_cut_fraction * total
        forced = config.full_refresh_every > 0 and self._frames_since_full + 1 >= config.full_refresh_every
        if scene_cut or forced:
            candidates = np.arange(total, dtype=np.int64)
        else:
            candidates = np.flatnonzero(drift >= threshold)
        # Most-changed first; ties keep row-major order (stable sort on the negated drift).
        refresh = candidates[np.argsort(-drift[candidates], kind="stable")]
        if config.max_age and 0 < refresh.size < total:  # then the oldest of the rest (a still frame reuses all)
            rest = np.ones(total, np.bool_)
            rest[refresh] = False
            rest &= self._age > 0
            older = np.flatnonzero(rest)
            older = older[np.argsort(-self._age[older], kind="stable")][: math.ceil(total / config.max_age)]
            refresh = np.concatenate([refresh, older])
        if max_refresh is not None:
            refresh = refresh[:max_refresh]
        refresh.flags.writeable = False
        drift.flags.writeable = False
        return ReusePlan(refresh, drift, refresh.size == total, bool(forced), bool(scene_cut),
                         1.0 - refresh.size / total, float(threshold), max_refresh, self._basis)

    def commit(self, plan: ReusePlan, rgb: np.ndarray) -> None:
        """Adopt `plan` for the frame it was made from: copy only its refreshed patches into the reference.

        Refuses (ValueError) a plan made by another gate or against a state this gate has since left."""
        require(isinstance(plan, ReusePlan), "plan", plan, "a ReusePlan from this gate's plan()")
        if plan.basis != self._basis:
            raise ValueError(
                f"plan.basis = {plan.basis}: stale or foreign plan; expected a plan made by this gate since its "
                f"last commit or reset (basis {self._basis})")
        self._check_frame(rgb)
        if plan.full:
            np.copyto(self._reference, rgb)
            self._frames_since_full = 0
            self._age.fill(0)
        else:
            if plan.refresh.size:  # reused patches age only while something changes around them
                self._age += 1
                self._age[plan.refresh] = 0
            rows, cols = self.grid
            p = self.patch_size
            r, c = np.divmod(plan.refresh, cols)  # each refreshed patch's (row, col) in the grid
            # (H, W, 3) -> (rows, P, cols, P, 3): copy the refreshed patches only, [k, P, P, 3]
            self._reference.reshape(rows, p, cols, p, 3)[r, :, c] = rgb.reshape(rows, p, cols, p, 3)[r, :, c]
            self._frames_since_full += 1
        self._has_reference = True
        self._basis = next(_basis_tokens)

    def reset(self) -> None:
        """Forget the reference: the next frame is a full refresh. Outstanding plans become stale."""
        self._reference.fill(0)
        self._has_reference = False
        self._frames_since_full = 0
        self._age.fill(0)
        self._basis = next(_basis_tokens)

    # ------------------------------------------------------------------ internals

    def _check_frame(self, rgb: np.ndarray) -> None:
        if not (isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.shape == self.image_shape):
            got = f"{rgb.dtype}{list(rgb.shape)}" if isinstance(rgb, np.ndarray) else type(rgb).__name__
            raise ValueError(f"rgb = {got}: expected uint8{list(self.image_shape)} (already resized to the model input)")

    def _drift(self, rgb: np.ndarray) -> np.ndarray:
        """Mean absolute difference of each patch against the reference -> float32[num_patches]."""
        rows, cols = self.grid
        p = self.patch_size
        np.subtract(rgb, self._reference, out=self._diff, dtype=np.int16)
        np.abs(self._diff, out=self._diff)
        # (H, W, 3) -> (rows, P, W*3): sum the P pixel rows of each patch row -> (rows, W*3)
        np.add.reduce(self._diff.reshape(rows, p, -1), axis=1, out=self._column_sums)
        # (rows, W*3) -> (rows, cols, P*3): a patch's P pixels x 3 channels per row are contiguous -> (rows, cols)
        np.add.reduce(self._column_sums.reshape(rows, cols, p * 3), axis=2, out=self._patch_sums, dtype=np.int64)
        # (rows, cols) -> (num_patches,), row-major patch index
        drift = self._patch_sums.reshape(-1).astype(np.float32)
        drift /= np.float32(self._pixels_per_patch)  # exact where the mean is representable
        return drift


