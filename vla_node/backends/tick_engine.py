"""The eager policy's compiled action tick: TickStep compiled by AOTInductor (inductor_engine.py), kept in the store.

The eager policy's tick runs the decoder's layers op by op; its block is small (S + H*D rows) and its matmuls read
the weights at memory speed, so Python, dispatch and the unfused norms, RoPE and activations are most of its time.
TickStep compiled ahead of time runs the same block as one native call. Measured on a 2-vCPU Intel Xeon (AMX, one
thread, `small`, bf16 packed weights, 2026-12-03), the whole action tick alternating with the eager one in one
process: 0.83x compiled with freezing alone, 0.59x with inductor_engine.INDUCTOR_OPTIONS (autotuned GEMMs).

The package is specialized to the bound buffers' layouts (runtime/compiled_tick.tick_buffers: the prefix K/V are
views of the policy's prefix buffer), the compute dtype, the CPU and the thread count; the store's key holds them all,
with the decoder's weights (their digest) and the compiler's versions. A store miss compiles it (tens of seconds on
`small`, progress shown); a hit loads it in a fraction of a second. The folder holds tick.pt2 and tick.json (the
layouts, compile time, and the parity of the compiled step against the eager TickStep on seeded inputs).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from vla_node.backends import inductor_engine
from vla_node.backends.engine_set import STEPS_VERSION, step_specs
from vla_node.backends.export import parity
from vla_node.backends.inductor_engine import InductorEngine, layout
from vla_node.backends.steps import TickStep
from vla_node.backends.store import EngineKey, EngineStore, device_description
from vla_node.model.vla import VLA

PACKAGE = "tick.pt2"
INPUTS = ("state_x", "positions", "prefix_k", "prefix_v", "bias")  # TickStep's, in its order
OUTPUTS = ("logits", "state_k", "state_v")


def compiler_version() -> str:
    """The first line of `$CXX --version` (inductor_engine.cxx), or why there is none."""
    try:
        out = subprocess.run([inductor_engine.cxx(), "--version"], capture_output=True, text=True, check=False).stdout
    except OSError as e:
        return f"no C++ compiler ({e})"
    return out.splitlines()[0] if out else "unknown C++ compiler"


def tick_key(decoder_digest: str, inputs: Mapping[str, torch.Tensor], threads: int,
             options: Mapping[str, object]) -> EngineKey:
    """What the compiled tick depends on: weights, layouts (shape, strides, dtype), CPU, intra-op threads (the
    generated kernels' parallelism is fixed when they are compiled), versions."""
    dtype = str(inputs["state_x"].dtype).removeprefix("torch.")
    layouts = "; ".join(f"{n} {layout(t)}" for n, t in inputs.items())
    return EngineKey(step="tick", recipe=dtype, backend="inductor",
                     backend_version=f"torch {torch.__version__}; {compiler_version()}",
                     device=device_description("cpu"), weights=decoder_digest,
                     shapes=tuple((n, tuple(t.shape)) for n, t in inputs.items()),
                     options=f"steps v{STEPS_VERSION}; threads {threads}; {dict(options)}; {layouts}")


def example_inputs(model: VLA, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tick spec's seeded inputs (engine_set.step_specs) in tensors laid out as `inputs` (views' strides too)."""
    seeded = step_specs(model.config, 0, False)["tick"].inputs()
    return {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(seeded[n]) for n, t in inputs.items()}


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_tick(plain_model: VLA, inputs: Mapping[str, torch.Tensor], threads: int, options: Mapping[str, object],
               folder: Path, progress: Callable[[str], None]) -> None:
    """TickStep of `plain_model` (its plain linear layers) at the dtype and layouts of `inputs`, for `threads`
    intra-op threads, compiled with inductor's `options` into `folder`, its parity against the eager step measured."""
    dtype = inputs["state_x"].dtype
    step = TickStep(plain_model.to(dtype)).eval()
    examples = example_inputs(plain_model, inputs)
    progress(f"compiling the action tick ({plain_model.config.name}, {str(dtype).removeprefix('torch.')}) with "
             "AOTInductor: once per weights and machine, about a minute on `small`")
    t0 = time.monotonic()
    with intra_op_threads(threads):
        inductor_engine.compile_step(step, examples, folder / PACKAGE, options)
    seconds = time.monotonic() - t0
    engine = InductorEngine(folder / PACKAGE, INPUTS, OUTPUTS, {n: layout(t) for n, t in examples.items()})
    with torch.inference_mode():
        expected = step(*examples.values())
    got = {n: torch.empty_like(t) for n, t in zip(engine.output_names, expected)}
    engine.run(examples, got)
    figures = parity([t.float().numpy() for t in expected], [got[n].float().numpy() for n in engine.output_names],
                     engine.output_names)
    sidecar = {"step": "tick", "compile_s": round(seconds, 1), "layouts": {n: repr(layout(t)) for n, t in
                                                                           examples.items()},
               "parity_vs_eager_step": figures, "torch": torch.__version__, "options": dict(options)}
    (folder / "tick.json").write_text(json.dumps(sidecar, indent=2) + "\n")
    progress(f"compiled in {seconds:.0f} s; logits within {figures['logits']['max_rel']:.1e} of the eager step")


def tick_engine(store: EngineStore, decoder_digest: str, plain_model: Callable[[], VLA],
                inputs: Mapping[str, torch.Tensor], threads: int, build: bool, build_command: str,
                progress: Callable[[str], None], options: Mapping[str, object] | None = None) -> InductorEngine:
    """The compiled tick (inductor `options`, default inductor_engine.INDUCTOR_OPTIONS) for a policy binding `inputs`
    (tick_buffers) and running `threads` intra-op threads, from the store, compiled first where missing
    (`plain_model()` loads the weights whose decoder digest is `decoder_digest`) unless `build` is false: then an
    EngineStoreError naming `build_command`."""
    if tuple(inputs) != INPUTS:
        raise ValueError(f"tick inputs {tuple(inputs)}: expected {INPUTS}")
    options = inductor_engine.INDUCTOR_OPTIONS if options is None else options
    key = tick_key(decoder_digest, inputs, threads, options)
    make = (lambda tmp: build_tick(plain_model(), inputs, threads, options, tmp, progress)) if build else None
    folder = store.get(key, make, build_command)
    return InductorEngine(folder / PACKAGE, INPUTS, OUTPUTS, {n: layout(t) for n, t in inputs.items()})
