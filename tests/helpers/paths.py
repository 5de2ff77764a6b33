"""Where the tests find things: the repository, the test launch files and the real dashcam clips."""

import os
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent
TEST_LAUNCH_DIR = TESTS_DIR / "launch"
# the shared real clips (MIT licence), beside the checkout; VLA_NODE_DRIVES points elsewhere
DRIVES_DIR = Path(os.environ.get("VLA_NODE_DRIVES", REPO_ROOT.parent / "shared" / "data" / "drives"))
