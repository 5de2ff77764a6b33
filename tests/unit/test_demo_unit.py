"""The demo: synthetic drive -> node -> report, with nothing but the package (tiny model to stay fast)."""

from __future__ import annotations

import pytest

from vla_node.drives.demo import demo
from vla_node.validate import ConfigError


def test_demo_rejects_a_bad_length(tmp_path):
    with pytest.raises(ConfigError, match="seconds"):
        demo(tmp_path, seconds=0)
