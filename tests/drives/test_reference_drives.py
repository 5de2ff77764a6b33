"""The reference policy on real decoded dashcam frames and on the synthetic drive."""

import pytest

from helpers.model_checks import run_reference
from vla_node.drives.video import decode_video


@pytest.mark.parametrize("clip", ["day_freeway_solid_white_right.mp4", "day_freeway_two_cars.mp4",
                                  "day_freeway_tree_shadows.mp4"])
def test_reference_runs_on_real_clip(drives_dir, clip):
    frames = [rgb for _, rgb in decode_video(drives_dir / clip, fps=5, max_frames=4)]
    assert len(frames) == 4 and frames[0].ndim == 3
    run_reference(frames)


