"""model.threads = "auto" on a running node: resolved at start to every CPU where its publisher may run at SCHED_FIFO
(util-linux's chrt is the oracle of that permission), else to one; the health message says the count it runs."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from helpers.node_harness import TINY_LAUNCH, running_node

pytestmark = pytest.mark.skipif(shutil.which("chrt") is None or not hasattr(os, "sched_getaffinity"),
                                reason="chrt (util-linux) is the oracle of the SCHED_FIFO permission; Linux")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("priority", [0, 10], ids=["no SCHED_FIFO asked", "SCHED_FIFO 10"])
def test_auto_threads_resolve_at_start_as_the_fifo_permission_says(tmp_path, priority):
    launch = tmp_path / "auto.toml"
    text = TINY_LAUNCH.read_text().replace("threads = 1", 'threads = "auto"')
    launch.write_text(text.replace("[realtime]", f"[realtime]\nsched_fifo_priority = {priority}"))
    permitted = priority > 0 and subprocess.run(["chrt", "--fifo", str(priority), "true"],
                                                capture_output=True).returncode == 0
    with running_node(launch, tmp_path) as node:
        node.warm_up()
        health = node.health()
    assert health["threads"] == (len(os.sched_getaffinity(0)) if permitted else 1)
