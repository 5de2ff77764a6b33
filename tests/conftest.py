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
