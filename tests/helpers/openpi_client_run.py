"""Run by tests/node/test_openpi.py with the python of a virtual environment holding openpi-client from PyPI,
unchanged (numpy < 2): drives a node's openpi endpoint as openpi's own clients do and prints one JSON line.

usage: python openpi_client_run.py PORT ROUNDS CLIENTS ROUNDS_EACH
Phases: one client `infer`s ROUNDS times (round trip per call), sends bad observations (each must raise the server's
error text and leave the connection usable), then CLIENTS clients at once `infer` ROUNDS_EACH times each.
"""

import json
import sys
import threading
import time

import numpy as np
from openpi_client import websocket_client_policy

PORT, ROUNDS, CLIENTS, ROUNDS_EACH = (int(a) for a in sys.argv[1:5])
rng = np.random.default_rng(0)


def observation(i: int) -> dict:
    return {  # openpi's LIBERO example's keys, plus one the node's mapping does not name
        "observation/image": rng.integers(0, 256, (96, 128, 3), dtype=np.uint8),
        "observation/wrist_image": np.zeros((32, 32, 3), np.uint8),
        "observation/state": np.array([0.1 * i, 0.0, 5.0, 0.0], np.float32),
        "prompt": "keep lane",
    }


def infer(policy, obs: dict) -> tuple[float, dict]:
    start = time.monotonic_ns()
    out = policy.infer(obs)
    return (time.monotonic_ns() - start) / 1e6, out


policy = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=PORT)
result = {"metadata": policy.get_server_metadata(), "numpy": np.__version__}
round_trips, statuses, shapes = [], [], set()
for i in range(ROUNDS):
    ms, out = infer(policy, observation(i))
    round_trips.append(ms)
    statuses.append(f'{out["source"]}/{out["status"]}')
    shapes.add((tuple(out["actions"].shape), str(out["actions"].dtype)))
result.update(round_trip_ms=round_trips, statuses=statuses, shapes=sorted(shapes),
              server_timing=out["server_timing"], last_frame_seq=out["frame_seq"])

bad = {
    "missing_image": {"observation/state": np.zeros(4, np.float32)},
    "float_image": {"observation/image": np.zeros((8, 8, 3), np.float32)},
    "state_dim": {"observation/image": np.zeros((8, 8, 3), np.uint8), "observation/state": np.zeros(7, np.float32)},
    "complex_state": {"observation/image": np.zeros((8, 8, 3), np.uint8), "observation/state": np.zeros(4, complex)},
    "prompt_type": {"observation/image": np.zeros((8, 8, 3), np.uint8), "prompt": 7},
}
errors = {}
for name, obs in bad.items():
    try:
        policy.infer(obs)
        errors[name] = None
    except Exception as e:  # the server's text reply (RuntimeError) or their packer refusing (complex dtype)
        errors[name] = f"{type(e).__name__}: {e}"
_, after_bad = infer(policy, observation(0))
result.update(errors=errors, after_bad=after_bad["status"])

many: list[dict] = []
lock = threading.Lock()


def one_client() -> None:
    own = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=PORT)
    for i in range(ROUNDS_EACH):
        ms, out = infer(own, observation(i))
        with lock:
            many.append({"ms": ms, "status": out["status"], "source": out["source"],
                         "shape": list(out["actions"].shape)})


threads = [threading.Thread(target=one_client) for _ in range(CLIENTS)]
start = time.monotonic()
for t in threads:
    t.start()
for t in threads:
    t.join()
result.update(many=many, many_s=time.monotonic() - start)
print(json.dumps(result))
