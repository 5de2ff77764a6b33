"""Four tiers, one folder each; the folder sets the marker (unit, backend, node, drives).

`realtime` marks what needs the cores to itself: every node-tier test (a node process with deadlines, a client, a
replay at its recorded rate) and the drives tests that start a node. `make test` runs everything else in parallel
processes first, then the realtime tests one at a time."""

from pathlib import Path

import pytest
import torch

from helpers.paths import DRIVES_DIR

# The machine is shared and small: keep each test process to one intra-op thread so parallel test
# processes do not oversubscribe the cores.
torch.set_num_threads(1)

TIERS = ("unit", "backend", "node", "drives")


def in_parallel_run(config: pytest.Config) -> bool:
    """A pytest-xdist worker: other test processes share the cores (make test's first part)."""
    return hasattr(config, "workerinput")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(item.path).parent.name
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test file belongs in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "node":
            item.add_marker(pytest.mark.realtime)
    if in_parallel_run(config):  # the longest files first, so that the run does not end waiting on one of them
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def drives_dir() -> Path:
    if not DRIVES_DIR.is_dir() or not list(DRIVES_DIR.glob("*.mp4")):
        pytest.skip(f"real drives not found at {DRIVES_DIR} (set VLA_NODE_DRIVES to the folder of dashcam clips)")
    return DRIVES_DIR


# A short behaviour-cloning run of the tiny bins policy (about a minute), shared by the unit tests that check it learned
# and that it resumes (what a finished run drives: the kept checkpoints, tests/unit/test_checkpoints.py).
TRAINED_TINY = dict(preset="tiny", action_head="bins", steps=600, episodes=32, save_every=300, warmup_steps=50)


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory, pytestconfig) -> tuple[Path, dict]:
    from vla_node.train.trainer import TrainConfig, train

    path = tmp_path_factory.mktemp("trained") / "tiny-bins"
    parallel = dict(threads=1, workers=1) if in_parallel_run(pytestconfig) else {}  # the other cores run other tests
    state = train(TrainConfig(**TRAINED_TINY, **parallel), path, progress=False)
    torch.set_num_threads(1)  # training took every core; the other tests keep to one
    return path, state


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """backends/cpu_kernels.library() rebuilt from scratch into tmp_path; the process's own cached one restored
    afterwards."""
    from vla_node.backends import cpu_kernels

    monkeypatch.setenv("VLA_NODE_KERNEL_DIR", str(tmp_path))
    cpu_kernels.library.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    cpu_kernels.library.cache_clear()
    cpu_kernels.library()


@pytest.fixture
def attention_on_the_kernel(monkeypatch):
    """Policies built in the test attend by the fused attention kernel, as on a CPU whose oneDNN runs no AMX: where it
    does (an Intel Xeon with AMX), a bf16 policy takes SDPA instead (runtime/policy.fused_attention_pays) and none of
    the native layers builds, though their C code and the kernels under it are the same to check there."""
    from vla_node.backends import cpu_features
    from vla_node.runtime import policy

    monkeypatch.setattr(cpu_features, "onednn_runs_amx", lambda: False)
    monkeypatch.setattr(policy, "onednn_runs_amx", lambda: False)
