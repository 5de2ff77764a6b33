"""Checks of the command line: a tiny drive, and the one-line user error."""

from __future__ import annotations

from vla_node.drives.native import DriveWriter


def tiny_drive(path):
    with DriveWriter(path) as writer:
        for i in range(3):
            writer.add_frame("front", i, i * 100_000_000, "rgb8", 8, 8, bytes(192))
    return path


def error_line(capsys, command: str, *fragments: str) -> None:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith(f"vla-node {command}: error: ")
    for fragment in fragments:
        assert fragment in last
