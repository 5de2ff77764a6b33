"""`.ci/gpu`'s engine table: each step on CUDA, torch eager against the cudagraph backend (and TensorRT where it is
installed), parity and per-step time side by side, for `small` and `base`.

    python -m vla_node.bench.gpu_engines --out OUT/engines.json

CUDA only: on a machine without a GPU it says so and exits 2. Not run in CI (no GPU there).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vla_node.backends.engine import TorchEngine
from vla_node.backends.engine_set import capacities, step_specs
from vla_node.backends.export import parity
from vla_node.model.config import preset
from vla_node.model.vla import build_vla

SAMPLES = 8


def _steps(c) -> list[str]:
    """The steps a frame and a tick run: text, tick, the tower and the decoder with the tick, full and the smallest
    partial capacity."""
    tower, frame = capacities(c.tokens_per_camera, SAMPLES), capacities(c.tokens_per_frame, SAMPLES)
    return ["text", "tick", f"tower-{tower[-1]}", f"tower-{tower[0]}", f"decoder-tick-{frame[-1]}",
            f"decoder-tick-{frame[0]}"]


def _time(run, iters: int) -> float:
    run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return float(np.median(samples))


def _engines(model, spec, folder: Path) -> dict:
    from vla_node.backends.cudagraph_engine import CudaGraphEngine

    names = list(spec.inputs())
    engines = {"torch": TorchEngine(spec.build(model), names, spec.outputs),
               "cudagraph": CudaGraphEngine(spec.build(model), names, spec.outputs)}
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return engines
    from vla_node.backends.build import build_step
    from vla_node.backends.tensorrt_engine import TensorRTEngine

    cpu_model = build_vla(model.config, seed=0)
    build_step(cpu_model, spec, "tensorrt", "fp32", folder)
    engines["tensorrt"] = TensorRTEngine(folder / f"{spec.name}.plan", cuda_graph=True)
    return engines


def run(presets=("small", "base"), iters: int = 20) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("bench gpu_engines: no CUDA GPU visible to torch; run it on a GPU machine (.ci/gpu)")
    table = {}
    for name in presets:
        c = preset(name)
        model = build_vla(c, seed=0).cuda().eval()
        specs = step_specs(c, SAMPLES, tick_in_frame=True)
        for step in _steps(c):
            spec = specs[step]
            inputs = {n: t.cuda() for n, t in spec.inputs().items()}
            with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
                engines = _engines(model, spec, Path(tmp))
                reference = [t.float() for t in spec.build(model)(*inputs.values())]
                row = {}
                for backend, engine in engines.items():
                    outputs = {n: torch.empty_like(t) for n, t in zip(spec.outputs, reference)}
                    ms = _time(lambda: engine.run(inputs, outputs), iters)
                    figures = parity([t.cpu().numpy() for t in reference],
                                     [outputs[n].float().cpu().numpy() for n in spec.outputs], spec.outputs)
                    row[backend] = {"ms": round(ms, 3), "max_rel": max(f["max_rel"] for f in figures.values())}
                table[f"{name}/{step}"] = row
                print(f"{name:<6}{step:<22}" + "  ".join(f"{b} {r['ms']:8.3f} ms (rel {r['max_rel']:.1e})"
                                                         for b, r in row.items()), flush=True)
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "iters": iters, "steps": table}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the table")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    result = run(iters=args.iters)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
