"""The reference policy on real decoded dashcam frames and on the synthetic drive."""

import numpy as np
import pytest

from vla_node.model import build_vla, preset
from vla_node.reference import ReferencePolicy
from vla_node.synthetic import SyntheticDriveConfig, synthetic_frames
from vla_node.video import decode_video


def run_reference(frames):
    policy = ReferencePolicy(build_vla(preset("tiny"), seed=0))
    chunks = [policy.step([rgb], "keep the lane", np.zeros(4, np.float32)) for rgb in frames]
    for chunk in chunks:
        assert chunk.actions.shape == (4, 2) and np.isfinite(chunk.actions).all()
        assert chunk.bins.min() >= 0 and chunk.bins.max() < 256
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
