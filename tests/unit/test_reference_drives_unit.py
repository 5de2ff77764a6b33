"""The reference policy on real decoded dashcam frames and on the synthetic drive."""


from helpers.model_checks import run_reference
from vla_node.drives.synthetic import SyntheticDriveConfig, synthetic_frames


def test_reference_runs_on_synthetic_drive():
    config = SyntheticDriveConfig(width=320, height=240, fps=10, seconds=0.5, seed=3)
    chunks = run_reference([rgb for _, rgb in synthetic_frames(config)])
    assert len(chunks) == 5
