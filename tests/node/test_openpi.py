"""openpi's websocket policy protocol beside ZeroMQ, driven by the real openpi-client from PyPI in its own virtual
environment (tests/helpers/openpi_client_run.py): chunks of the model's shape, a clear error for a bad
observation on a connection that stays usable, many clients at once while the control tick keeps its rate."""

from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import pytest
import zmq

from helpers.node_harness import REPO_ROOT, TINY_LAUNCH, running_node
from helpers.openpi_venv import openpi_client_python
from vla_node.bench.node import free_tcp_port, tick_figures
from vla_node.wire.protocol import decode_action

CLIENT_RUN = REPO_ROOT / "tests" / "helpers" / "openpi_client_run.py"
ROUNDS, CLIENTS, ROUNDS_EACH = 30, 8, 5


@pytest.fixture(scope="module")
def openpi_python():
    return openpi_client_python()


def openpi_launch(tmp_path, port: int):
    path = tmp_path / "openpi.toml"
    path.write_text(TINY_LAUNCH.read_text() + f'\n[openpi]\nlisten = "ws://127.0.0.1:{port}"\n')
    return path


@pytest.mark.timeout(600)
def test_the_openpi_client_drives_the_node(tmp_path, openpi_python):
    port = free_tcp_port()
    with running_node(openpi_launch(tmp_path, port), tmp_path) as node:  # a ZeroMQ client beside it
        node.warm_up()
        zmq_ms = []  # the ZeroMQ path's frame-to-action latency, measured beside it (printed, not asserted)
        for _ in range(ROUNDS):
            start = time.monotonic_ns()
            node.send_and_wait_fresh()
            zmq_ms.append((time.monotonic_ns() - start) / 1e6)
        run = subprocess.Popen([str(openpi_python), str(CLIENT_RUN), str(port), str(ROUNDS), str(CLIENTS),
                                str(ROUNDS_EACH)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stamps, seqs, arrivals = [], [], []  # the node's ticks, seen by the ZeroMQ client meanwhile
        sock = node.client.actions_sub
        while run.poll() is None:
            if sock.poll(50):
                while True:
                    try:
                        action = decode_action(sock.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    stamps.append(action["stamp_ns"])
                    seqs.append(action["seq"])
                    arrivals.append(time.monotonic_ns())
        out, err = run.communicate()
        assert run.returncode == 0, err[-3000:]
        result = json.loads(out)
        expected = ROUNDS + 1 + CLIENTS * ROUNDS_EACH  # good observations; and every connection closed by now
        health = node.health(timeout_s=10.0, until=lambda h: h.get("openpi", {}).get("observations") == expected
                             and h["openpi"]["clients"] == 0)

    meta = result["metadata"]
    assert meta["server"] == "vla-node" and meta["action_horizon"] == 4 and meta["action_dim"] == 2, meta
    assert result["numpy"].startswith("1."), result["numpy"]  # their environment, not ours
    assert result["shapes"] == [[[4, 2], "float32"]], result["shapes"]
    # one client at a time: its own frame's fresh action (on a loaded machine a tick may take it first: chunk)
    assert set(result["statuses"]) <= {"own_frame/fresh", "own_frame/chunk"} and "own_frame/fresh" in \
        result["statuses"], result["statuses"]
    # a bad observation: the server's error text raised by their client, naming what was wrong; the connection lives
    errors = result["errors"]
    assert "missing_key" in errors["missing_image"] and "observation/image" in errors["missing_image"], errors
    assert "bad_image" in errors["float_image"] and "uint8" in errors["float_image"], errors
    assert "bad_state" in errors["state_dim"] and "4 finite numbers" in errors["state_dim"], errors
    assert errors["complex_state"] and "bad_prompt" in errors["prompt_type"], errors
    assert result["after_bad"] in ("fresh", "chunk", "fallback")
    many = result["many"]
    assert len(many) == CLIENTS * ROUNDS_EACH and all(m["shape"] == [4, 2] for m in many), many
    # many at once: the node takes the newest frame; the others are answered as soon as it has, not at the timeout
    sources = {m["source"] for m in many}
    assert "own_frame" in sources and sources <= {"own_frame", "newer_frame"}, many
    # counted in health: observations, replies by status, errors by reason, the key no mapping names
    openpi = health["openpi"]
    assert openpi["observations"] == expected, openpi
    assert sum(openpi["replies"].values()) == sum(openpi["answered"].values()) == openpi["observations"], openpi
    assert openpi["errors"] == {"missing_key": 1, "bad_image": 1, "bad_state": 1, "bad_prompt": 1}, openpi
    assert openpi["ignored_keys"] == {"observation/wrist_image": openpi["observations"]}, openpi
    assert openpi["connections"] == 1 + CLIENTS and openpi["clients"] == 0, openpi
    # the control tick kept its rate while the clients ran (the publisher process ticks; nothing here can stall it)
    ticks = tick_figures(stamps, seqs, arrivals, period_ns=20_000_000)
    assert ticks["lost"] == 0 and ticks["received"] >= 0.95 * ticks["expected"], ticks
    rt, zt = np.array(result["round_trip_ms"]), np.array(zmq_ms)
    print(f"openpi infer round trip ms p50 {np.percentile(rt, 50):.1f} p99 {np.percentile(rt, 99):.1f}; ZeroMQ frame "
          f"to fresh action ms p50 {np.percentile(zt, 50):.1f} p99 {np.percentile(zt, 99):.1f}; {CLIENTS} clients x "
          f"{ROUNDS_EACH} in {result['many_s']:.2f} s; ticks {ticks}")
