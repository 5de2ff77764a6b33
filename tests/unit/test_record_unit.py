"""Record: a live tiny node's traffic into a native drive that reads back and replays; the writer queue's drop
accounting; argument errors."""

from __future__ import annotations

import time

import pytest

from helpers.node_helpers import TINY_LAUNCH
from vla_node.drives.record import record
from vla_node.node.process import private_addresses
from vla_node.validate import ConfigError


def test_record_arguments_and_duration(tmp_path):
    existing = tmp_path / "exists.mcap"
    existing.write_bytes(b"x")
    with pytest.raises(FileExistsError, match="exists.mcap exists"):
        record(TINY_LAUNCH, existing, duration_s=1)
    with pytest.raises(ConfigError, match="duration_s"):
        record(TINY_LAUNCH, tmp_path / "a.mcap", duration_s=0)
    with pytest.raises(ConfigError, match="addresses"):
        record(TINY_LAUNCH, tmp_path / "a.mcap", duration_s=1, addresses={"action": "ipc://@x"})
    curve = tmp_path / "curve.toml"
    curve.write_text(TINY_LAUNCH.read_text() + '\n[transport]\ncurve_keys_dir = "keys"\n')
    with pytest.raises(ConfigError, match="CURVE"):
        record(curve, tmp_path / "a.mcap", duration_s=1)
    start = time.monotonic()
    summary = record(TINY_LAUNCH, tmp_path / "quiet.mcap", duration_s=0.3, addresses=private_addresses(),
                     progress=False)
    assert 0.3 <= time.monotonic() - start < 5 and not any(summary.written.values())
    assert (tmp_path / "quiet.mcap").stat().st_size > 0  # a finished, empty MCAP
