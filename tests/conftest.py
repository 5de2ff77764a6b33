import os
from pathlib import Path

import pytest
import torch

# The machine is shared and small: keep each test process to one intra-op thread so parallel test
# processes do not oversubscribe the cores.
torch.set_num_threads(1)


def drives_path() -> Path:
    env = os.environ.get("VLA_NODE_DRIVES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data" / "drives"


@pytest.fixture(scope="session")
def drives_dir() -> Path:
    path = drives_path()
    if not path.is_dir() or not list(path.glob("*.mp4")):
        pytest.skip(f"real drives not found at {path} (set VLA_NODE_DRIVES to the folder of dashcam clips)")
    return path
