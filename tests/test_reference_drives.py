"""The reference policy on real decoded dashcam frames and on the synthetic drive."""

import numpy as np
import pytest
import torch

from vla_node.model import build_vla, preset
from vla_node.multirate import CacheConfig, MultiRatePolicy
from vla_node.reference import ReferencePolicy
from vla_node.synthetic import SyntheticDriveConfig, synthetic_frames
from vla_node.video import decode_video


def run_reference(frames):
    """The reference on the frames, checked against the multi-rate policy with the exact (all-fp32) cache over the
    same frames (1e-4 on logits, the same bins); every frame's logits depend on the frame, and on the instruction."""
    model = build_vla(preset("tiny"), seed=0)
    policy = ReferencePolicy(model)
    state = np.zeros(4, np.float32)
    chunks = [policy.step([rgb], "keep the lane", state) for rgb in frames]
    incremental = MultiRatePolicy(model, CacheConfig.exact())
    incremental.update_text("keep the lane")
    for chunk, rgb in zip(chunks, frames):
        assert chunk.actions.shape == (4, 2) and np.isfinite(chunk.actions).all()
        assert chunk.bins.min() >= 0 and chunk.bins.max() < 256
        incremental.update_vision(incremental.prepare_frames([rgb]))
        ours = incremental.action_tick(state)
        assert (ours.logits - chunk.logits).abs().max().item() <= 1e-4
        np.testing.assert_array_equal(ours.bins, chunk.bins)
    for a, b in zip(chunks, chunks[1:]):
        assert not torch.equal(a.logits, b.logits)  # the frames differ, and so do the logits
    other = policy.step([frames[0]], "stop now", state)
    assert not torch.equal(other.logits, chunks[0].logits)
    return chunks


@pytest.mark.drives
@pytest.mark.parametrize("clip", ["day_freeway_solid_white_right.mp4", "day_freeway_two_cars.mp4",
                                  "day_freeway_tree_shadows.mp4"])
def test_reference_runs_on_real_clip(drives_dir, clip):
    frames = [rgb for _, rgb in decode_video(drives_dir / clip, fps=5, max_frames=4)]
    assert len(frames) == 4 and frames[0].ndim == 3
    run_reference(frames)


@pytest.mark.unit
def test_reference_runs_on_synthetic_drive():
    config = SyntheticDriveConfig(width=320, height=240, fps=10, seconds=0.5, seed=3)
    chunks = run_reference([rgb for _, rgb in synthetic_frames(config)])
    assert len(chunks) == 5
