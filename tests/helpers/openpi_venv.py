"""openpi-client from PyPI, unchanged, in a virtual environment of its own (it pins numpy < 2, the node uses 2.x):
made once under .cache/ (or $VLA_NODE_TEST_CACHE) and reused while it imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

OPENPI_CLIENT = "openpi-client==0.1.2"
MISSING_DEPENDENCY = "typing_extensions"  # its websocket_client_policy imports it; its metadata does not require it
CACHE = Path(os.environ.get("VLA_NODE_TEST_CACHE", Path(__file__).resolve().parents[2] / ".cache"))


def openpi_client_python() -> Path:
    """The python of a virtual environment with OPENPI_CLIENT installed (made here if missing: ~15-60 s)."""
    venv = CACHE / OPENPI_CLIENT.replace("==", "-")
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import openpi_client.websocket_client_policy"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", OPENPI_CLIENT,
                          MISSING_DEPENDENCY],
                         capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        raise RuntimeError(f"pip install {OPENPI_CLIENT} into {venv} failed (PyPI reachable?):\n{pip.stderr[-3000:]}")
    subprocess.run(check, check=True)
    return python
