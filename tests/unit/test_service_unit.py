"""launch/vla-node.service: the command it starts is one the CLI takes, with a launch file that loads; it restarts
on failure; its realtime limits cover what that launch file asks for (SCHED_FIFO priority, CPU affinity); and
systemd itself finds nothing wrong with it where systemd-analyze exists."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess

import pytest

from vla_node.cli import build_parser
from vla_node.config import REPO_ROOT, load_launch

UNIT = REPO_ROOT / "launch" / "vla-node.service"
INSTALLED_AT = "/opt/vla-node"


def service() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    assert set(parser.sections()) == {"Unit", "Service", "Install"}
    return parser["Service"]


def test_the_unit_starts_the_node_with_a_launch_file_that_loads_and_restarts_it_on_failure():
    s = service()
    argv = shlex.split(s["ExecStart"])
    assert argv[0] == f"{INSTALLED_AT}/.venv/bin/vla-node" and argv[1] == "run", argv
    args = build_parser().parse_args(argv[1:])
    launch = load_launch(args.launch.replace(INSTALLED_AT, str(REPO_ROOT)))
    assert s["Restart"] == "on-failure" and s["KillSignal"] == "SIGTERM"  # the node exits 1 on an error, 0 on TERM
    assert s["WorkingDirectory"] == INSTALLED_AT
    rt = launch.realtime
    assert rt.sched_fifo_priority > 0 and int(s["LimitRTPRIO"]) >= rt.sched_fifo_priority
    assert "CAP_SYS_NICE" in s["AmbientCapabilities"].split()
    assert tuple(int(c) for c in s["CPUAffinity"].split()) == rt.cpu_affinity


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_finds_nothing_wrong_with_the_unit(tmp_path):
    unit = tmp_path / "vla-node.service"  # where it would be installed: this checkout (its venv's vla-node exists)
    unit.write_text(UNIT.read_text().replace(INSTALLED_AT, str(REPO_ROOT)))
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr
