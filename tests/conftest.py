"""Four tiers, one folder each; the folder sets the marker (unit, backend, node, drives)."""

from pathlib import Path

import pytest
import torch

from helpers.paths import DRIVES_DIR

# The machine is shared and small: keep each test process to one intra-op thread so parallel test
# processes do not oversubscribe the cores.
torch.set_num_threads(1)

TIERS = ("unit", "backend", "node", "drives")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(item.path).parent.name
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test file belongs in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def drives_dir() -> Path:
    if not DRIVES_DIR.is_dir() or not list(DRIVES_DIR.glob("*.mp4")):
        pytest.skip(f"real drives not found at {DRIVES_DIR} (set VLA_NODE_DRIVES to the folder of dashcam clips)")
    return DRIVES_DIR


# A short behaviour-cloning run of the tiny bins policy (about a minute), shared by the unit tests that check it learned
# and that it resumes (what a finished run drives: the kept checkpoints, tests/unit/test_checkpoints.py).
TRAINED_TINY = dict(preset="tiny", action_head="bins", steps=600, episodes=32, save_every=300, warmup_steps=50)


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory) -> tuple[Path, dict]:
    from vla_node.train.trainer import TrainConfig, train

    path = tmp_path_factory.mktemp("trained") / "tiny-bins"
    state = train(TrainConfig(**TRAINED_TINY), path, progress=False)
    torch.set_num_threads(1)  # training took every core; the other tests keep to one
    return path, state
