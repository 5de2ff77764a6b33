"""The eager policy's action tick compiled by AOTInductor (backends/tick_engine.py, runtime/compiled_tick.py): the
same chunks and ring as the eager tick (fp32: to float rounding, bins equal; bf16 packed weights, the node's path:
within bf16 rounding), a stopped tick commits nothing, the store compiles once and then loads, a binding of another
layout is refused, and the launch file's compiled_tick resolves, falls back and fails as it says."""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers.paths import TEST_LAUNCH_DIR
from vla_node.backends import cpu_features, cpu_kernels, inductor_engine
from vla_node.backends.cpu_features import onednn_runs_amx
from vla_node.backends.inductor_engine import InductorEngine, inductor_problem, layout
from vla_node.backends.packed_weights import packed_weights_available
from vla_node.backends.store import EngineStore, weights_digest
from vla_node.backends.tick_engine import INPUTS, OUTPUTS, PACKAGE, tick_engine
from vla_node.cli import main
from vla_node.config import load_launch
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.node.policies import build_policies
from vla_node.runtime.compiled_tick import tick_buffers
from vla_node.runtime.policy import MultiRatePolicy, StageAborted
from vla_node.validate import ConfigError

pytestmark = pytest.mark.skipif(inductor_problem() is not None, reason=f"AOTInductor: {inductor_problem()}")
TINY = preset("tiny")
# the plumbing's tests compile without autotuning (a tenth of the time); the node-path test compiles the shipped options
FAST = {"freezing": True, "cpp_wrapper": True}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> EngineStore:
    return EngineStore(tmp_path_factory.mktemp("engines"))


def policy(store: EngineStore | None, cache: CacheConfig = CacheConfig.exact(), dtype=torch.float32
           ) -> MultiRatePolicy:
    """A tiny eager policy, its tick compiled into `store` (None: the eager tick)."""
    model = build_vla(TINY, seed=0)
    digest = weights_digest(model.decoder)
    p = MultiRatePolicy(model, cache, dtype)
    if store is not None:
        engine = tick_engine(store, digest, lambda: build_vla(TINY, seed=0), tick_buffers(p)[0], 1, True,
                             "vla-node build-engines", lambda line: None, FAST)  # 1 thread, as tiny.toml says
        p.use_compiled_tick(engine)
    return p


def drive(p: MultiRatePolicy, n: int = 4, seed: int = 0) -> list:
    """Chunks of: a text, n frames (full, then a few patches repainted; the second frame's tick in its pass, every
    frame followed by more ticks than the ring has slots: stale stored states after each commit, none stored yet
    after the first, then fresh ones), a text change and a tick after it."""
    rng = np.random.default_rng(seed)
    c, grid = p.config, p.config.image_size // p.config.patch_size
    image = rng.integers(0, 256, (1, c.image_size, c.image_size, 3), dtype=np.uint8)
    chunks = []
    p.update_text("keep the lane")
    for i in range(n):
        tokens = None
        if i:
            t = int(rng.integers(grid * grid))
            r, col = divmod(t, grid)
            image[0, r * c.patch_size : (r + 1) * c.patch_size, col * c.patch_size : (col + 1) * c.patch_size] = 0
            tokens = [torch.tensor([t])]
        update = p.update_vision(image, tokens, False, None, rng.normal(size=c.state_dim) if i == 1 else None)
        if update.chunk is not None:
            chunks.append(update.chunk)
        chunks += [p.action_tick(rng.normal(size=c.state_dim)) for _ in range(c.state_slots + 1)]
    p.update_text("turn left at the light")
    chunks.append(p.action_tick(rng.normal(size=c.state_dim)))
    return chunks


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


def test_the_compiled_tick_follows_the_eager_one(store):
    """fp32: every chunk's logits within 1e-4 relative (different kernels, the same sums), bins equal; the ring's
    K/V and validity as the eager ticks committed them (the compiled block recomputes the stored states: rows the
    eager non-stale tick reads from the ring instead)."""
    eager, compiled = policy(None), policy(store)
    assert compiled._compiled is not None and eager._compiled is None
    for i, (a, b) in enumerate(zip(drive(eager), drive(compiled), strict=True)):
        assert relative(a.logits, b.logits) < 1e-4, i
        assert (a.bins == b.bins).all(), i
    assert compiled.state_count == eager.state_count
    for a, b in zip(eager.action.storage_tensors(), compiled.action.storage_tensors(), strict=True):
        if a.is_floating_point():
            assert (a - b).abs().max() <= 1e-4 * a.abs().max()
        else:
            assert torch.equal(a, b)


def test_a_tick_stopped_before_its_call_commits_nothing(store):
    p = policy(store)
    drive(p, n=1)
    before = [t.clone() for t in p.action.storage_tensors()], p.state_count
    with pytest.raises(StageAborted, match="before the compiled tick"):
        p.action_tick(np.zeros(p.config.state_dim), check=lambda fraction: False)
    assert p.state_count == before[1]
    assert all(torch.equal(a, b) for a, b in zip(before[0], p.action.storage_tensors(), strict=True))


def test_the_store_compiles_once_then_loads(store, monkeypatch):
    """A second policy of the same weights and layouts loads the package (compiling again would fail here), and
    its sidecar holds the compiled step's parity against the eager step."""
    policy(store)  # compiled by now, whichever test ran first
    monkeypatch.setattr(inductor_engine, "compile_step", lambda *a: pytest.fail("compiled again"))
    p = policy(store)
    assert p._compiled is not None
    sidecars = list(store.root.glob("tick-float32-*/tick.json"))
    assert len(sidecars) == 1
    assert '"parity_vs_eager_step"' in sidecars[0].read_text()


def test_a_binding_of_another_layout_is_refused(store):
    p = policy(store)
    folder = next(store.root.glob("tick-float32-*"))
    inputs, outputs = tick_buffers(p)
    engine = InductorEngine(folder / PACKAGE, INPUTS, OUTPUTS, {n: layout(t) for n, t in inputs.items()})
    engine.run(inputs, outputs)
    inputs["prefix_k"] = inputs["prefix_k"].contiguous()  # the same shape and values, other strides
    with pytest.raises(ValueError, match=r"input prefix_k: shape, strides.*compiled for"):
        engine.run(inputs, outputs)


FRESH_PROCESS = """
import torch
from vla_node.backends.inductor_engine import InductorEngine, layout
from vla_node.backends.tick_engine import INPUTS, OUTPUTS
from vla_node.kv.cache_config import CacheConfig
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.compiled_tick import tick_buffers
from vla_node.runtime.policy import MultiRatePolicy

inputs, outputs = tick_buffers(MultiRatePolicy(build_vla(preset("tiny"), seed=0), CacheConfig(), torch.bfloat16))
InductorEngine(PACKAGE, INPUTS, OUTPUTS, {n: layout(t) for n, t in inputs.items()}).run(inputs, outputs)
print("ran", bool(outputs["logits"].isfinite().all()))
"""


def tiny_config(tmp_path, *overrides: str):
    return load_launch(TEST_LAUNCH_DIR / "tiny.toml", [f"model.engines_dir={tmp_path / 'engines'}", *overrides])


@pytest.mark.skipif(not (packed_weights_available() and onednn_runs_amx()),
                    reason="compiled_tick 'auto' compiles where packed bf16 weights run on AMX")
def test_the_node_path_compiles_its_tick_where_weights_are_packed(tmp_path, monkeypatch):
    """launch: dtype auto, weights auto, compiled_tick auto, as launch/cpu.toml: the tick compiled with the shipped
    options, the choice says so; its chunks within bf16 rounding of the eager tick's (logits 2e-2 relative, bins 90%
    the same). As where the CPU kernels do not run on AMX tiles themselves (where they do, auto keeps their tick)."""
    monkeypatch.setattr(cpu_kernels, "amx_tiles", lambda: False)
    auto = ("model.dtype=auto", "model.weights=auto")
    compiled, _, choice = build_policies(tiny_config(tmp_path, *auto, "model.compiled_tick=auto"))
    eager, _, eager_choice = build_policies(tiny_config(tmp_path, *auto, "model.compiled_tick=off"))
    assert choice.recipe == "packed weights, compiled tick (AOTInductor)" and eager_choice.recipe == "packed weights"
    pairs = list(zip(drive(eager), drive(compiled), strict=True))
    assert max(relative(a.logits, b.logits) for a, b in pairs) < 2e-2
    assert np.mean([(a.bins == b.bins).mean() for a, b in pairs]) >= 0.9
    # a fresh process where nothing else ran AMX first (the node's warm-up runs oneDNN's AMX kernels before a tick,
    # which asks for the tile registers; the package alone must too, or its first tile instruction is a SIGILL)
    package = next((tmp_path / "engines").glob(f"tick-bfloat16-*/{PACKAGE}"))
    code = FRESH_PROCESS.replace("PACKAGE", repr(str(package)))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ran True", (run.returncode, run.stderr[-2000:])


def test_build_engines_compiles_the_eager_policys_tick(store, tmp_path, monkeypatch, capsys):
    """`vla-node build-engines` (build_launch_engines) on backend torch: the compiled tick where compiled_tick resolves
    on, into the store (the other tests' package, where they ran first: the same key), which a node's start then
    loads; without it, nothing to build, said so."""
    monkeypatch.setattr(inductor_engine, "INDUCTOR_OPTIONS", FAST)
    launch = tmp_path / "tiny.toml"
    launch.write_text((TEST_LAUNCH_DIR / "tiny.toml").read_text().replace(
        "[model]\n", f'[model]\ncompiled_tick = "on"\nengines_dir = "{store.root}"\n', 1))
    assert main(["build-engines", "--launch", str(launch)]) == 0
    assert "the eager policy's compiled tick (tiny)" in capsys.readouterr().out
    assert len(list(store.root.glob(f"tick-float32-*/{PACKAGE}"))) == 1
    config = load_launch(launch, ["model.build_engines=false"])  # a start that may not build: loads it
    policy, _, choice = build_policies(config)
    assert policy.compiled_tick and choice.recipe.endswith("compiled tick (AOTInductor)")
    launch.write_text(launch.read_text().replace('compiled_tick = "on"', 'compiled_tick = "off"'))
    assert main(["build-engines", "--launch", str(launch)]) == 2
    assert "no engines to build unless its tick is compiled" in capsys.readouterr().err


def test_compiled_tick_resolves_falls_back_and_fails_as_the_launch_file_says(tmp_path, monkeypatch, caplog):
    assert not tiny_config(tmp_path, "model.compiled_tick=auto").model.resolved_compiled_tick  # fp32: not packed
    with pytest.raises(ConfigError, match="model.compiled_tick"):
        tiny_config(tmp_path, "model.compiled_tick=yes")
    with pytest.raises(ConfigError, match="compiled_tick = 'on': action_head = 'flow'"):
        build_policies(tiny_config(tmp_path, "model.compiled_tick=on", "model.action_head=flow"))
    with pytest.raises(ConfigError, match=r"no usable tick engine.*: not built; build it with `vla-node build-engines"):
        build_policies(tiny_config(tmp_path, "model.compiled_tick=on", "model.build_engines=false"))
    monkeypatch.setattr(inductor_engine.shutil, "which", lambda name: None)  # no C++ compiler
    with pytest.raises(ConfigError, match=r"compiled_tick = 'on': no C\+\+ compiler"):
        build_policies(tiny_config(tmp_path, "model.compiled_tick=on"))
    if packed_weights_available():  # auto: compiled where oneDNN runs AMX, unless the CPU kernels run on AMX tiles
        packed = tiny_config(tmp_path, "model.compiled_tick=auto", "model.dtype=bf16", "model.weights=packed").model
        monkeypatch.setattr(cpu_features, "onednn_runs_amx", lambda: True)
        monkeypatch.setattr(cpu_kernels, "amx_tiles", lambda: True)
        assert not packed.resolved_compiled_tick  # their tick whole in one C call measured faster
        monkeypatch.setattr(cpu_kernels, "amx_tiles", lambda: False)
        assert packed.resolved_compiled_tick
        monkeypatch.setattr(cpu_features, "onednn_runs_amx", lambda: False)
        assert not packed.resolved_compiled_tick
        monkeypatch.setattr(cpu_features, "onednn_runs_amx", onednn_runs_amx)
    if packed_weights_available() and onednn_runs_amx():  # 'auto' where it would compile: a warning, eager tick
        with caplog.at_level(logging.WARNING):
            p, _, choice = build_policies(tiny_config(tmp_path, "model.compiled_tick=auto", "model.dtype=bf16",
                                                      "model.weights=packed"))
        assert p._compiled is None and choice.recipe == "packed weights"
        assert "the eager tick runs (no C++ compiler" in caplog.text
