"""One export per step: the engine store exports a step once (its `exports/` store) and every recipe built from it
copies that export; a model with other weights is exported anew, and a corrupt export is exported again."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vla_node.backends import build as build_module
from vla_node.backends.engine_set import exported_engines, step_specs
from vla_node.backends.store import EXPORTS, EngineStore, weights_digest
from vla_node.model.config import preset
from vla_node.model.vla import build_vla

pytest.importorskip("onnxruntime", reason="onnxruntime runs the exported steps")


@pytest.fixture
def exports_made(monkeypatch) -> list:
    """The paths export_step wrote, in order (the real export runs)."""
    made = []
    real = build_module.export_step

    def counted(step, inputs, outputs, path, *args, **kwargs):
        made.append(path)
        return real(step, inputs, outputs, path, *args, **kwargs)

    monkeypatch.setattr(build_module, "export_step", counted)
    return made


def tick_only(model) -> dict:
    return {"tick": step_specs(model.config, 0, tick_in_frame=True)["tick"]}


def test_a_second_recipe_copies_the_steps_export_and_runs(tmp_path, exports_made):
    model = build_vla(preset("tiny"), seed=0)
    specs = tick_only(model)
    store = EngineStore(tmp_path)
    fp32 = exported_engines(model, specs, "onnxruntime", "fp32", store)
    int8 = exported_engines(model, specs, "onnxruntime", "int8-ort", store)
    assert len(exports_made) == 1 and exports_made[0].parent.parent == tmp_path / EXPORTS
    (export,) = (tmp_path / EXPORTS).iterdir()
    graph = (export / "tick.fp32.onnx").read_bytes()
    for engines in (fp32, int8):
        assert (engines.folders["tick"] / "tick.fp32.onnx").read_bytes() == graph
    sidecar = json.loads((int8.folders["tick"] / "tick.json").read_text())
    assert sidecar["recipe"]["recipe"] == "int8-ort"
    assert all(f["max_rel"] < 0.5 for f in sidecar["parity_onnxruntime_vs_torch"].values())  # quantized, not garbage
    spec = specs["tick"]
    inputs = {n: t.contiguous() for n, t in spec.inputs().items()}
    with torch.inference_mode():
        expected = spec.build(model).eval()(*inputs.values())
    for engines, tolerance in ((fp32, 1e-4), (int8, 0.5)):
        outputs = {n: torch.empty_like(t) for n, t in zip(spec.outputs, expected)}
        engines["tick"].run(inputs, outputs)
        for name, want in zip(spec.outputs, expected):
            got = outputs[name]
            assert np.isfinite(got.numpy()).all()
            assert float((got - want).abs().max() / want.abs().max()) < tolerance, (engines.recipe, name)


def test_other_weights_are_exported_anew_and_a_corrupt_export_again(tmp_path, exports_made):
    store = EngineStore(tmp_path)
    first = build_vla(preset("tiny"), seed=0)
    exported_engines(first, tick_only(first), "onnxruntime", "fp32", store)
    other = build_vla(preset("tiny"), seed=1)
    exported_engines(other, tick_only(other), "onnxruntime", "fp32", store)
    assert len(exports_made) == 2 and len(list((tmp_path / EXPORTS).iterdir())) == 2
    # the int8 build of the first model finds its export corrupt: exported again, not copied
    digest = weights_digest(first)
    (export,) = (p for p in (tmp_path / EXPORTS).iterdir()
                 if json.loads((p / "manifest.json").read_text())["key"]["weights"] == digest)
    (export / "tick.fp32.onnx").write_bytes(b"not a graph")
    exported_engines(first, tick_only(first), "onnxruntime", "int8-ort", store)
    assert len(exports_made) == 3 and exports_made[2].parent.parent == tmp_path / EXPORTS
