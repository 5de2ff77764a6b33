"""`vla-node bench all`: one quick run on the tiny model (no real clip: the synthetic drive, as on a fresh machine)
writes bench.json, bench.md and bench.html with every section, target and plot, the node replayed through real
sockets."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest

from helpers.node_helpers import TINY_LAUNCH
from vla_node.backends import packed_weights
from vla_node.bench import per_frame, suite
from vla_node.bench.suite_report import histogram_rows

pytest.importorskip("transformers", reason="transformers (the dev extra) is the peer")
pytest.importorskip("onnxruntime", reason="ONNX Runtime runs the int8 contender")


class _Svgs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.svgs = 0

    def handle_starttag(self, tag, attrs) -> None:
        self.svgs += tag == "svg"


def test_bench_all_writes_every_section_target_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(suite, "default_clip", lambda: None)  # as on a machine without the shared clips
    result = suite.run(tmp_path / "bench", launch=str(TINY_LAUNCH), quick=True)
    written = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert result["clip"].startswith("synthetic drive")
    h = result["header"]
    assert h["cpu"] and h["threads"] == 1 and h["versions"]["torch"] and "oneDNN" in h["kernels"]
    assert h["threads_from"] == "the launch file's model.threads = 1"  # no --threads: the launch file's
    m = result["model"]
    int8 = {"ours int8"} if m["compute_dtype"] == "bf16" and packed_weights.int8_weights_available() else set()
    assert set(m["ms"]) == {"ours", "onnxruntime int8", "reference", "peer", *int8}
    assert all(v > 0 for v in m["ms"].values()) and set(m["accuracy_vs_fp32_reference"]) == set(m["ms"]) - {
        "reference", "peer"}
    assert m["speedup_vs_hf"] == pytest.approx(m["ms"]["peer"] / m["ms"]["ours"], rel=0.01)  # ms are rounded
    fastest_int8 = min([m["ms"]["onnxruntime int8"], *(m["ms"][name] for name in int8)])
    assert m["int8_speedup_vs_hf"] == pytest.approx(m["ms"]["peer"] / fastest_int8, rel=0.01)
    assert bool(int8) == any("int8 weights" in key for key in result["stages"]["ms"])
    for a in m["accuracy_vs_fp32_reference"].values():
        assert 0 <= a["bins_agreement"] <= 1 and 0 <= a["logit_rel_err_mean"] <= a["logit_rel_err_max"]
    assert ("int8_floor" in m) == bool(int8)  # ours int8 against the floor with int8 weights
    for key, name in (("floor", "ours"), ("int8_floor", "ours int8"))[: 1 + len(int8)]:
        f = m[key]
        assert f["stage"] == "reuse_frame" and f["floor_ms"] > 0 and f["refreshed"] >= 1 and f["contender"] == name
        assert f["ratio_to_floor"] == pytest.approx(m["ms"][name] / f["floor_ms"], rel=0.01)
        assert ("attention_gflops" in f) == (key == "int8_floor")  # int8: the attention at bf16's rate
        assert f["samples"] == per_frame.FLOOR_SAMPLES
    floors = result["stages"]["floor"]
    assert {k.rsplit(": ", 1)[1] for k in floors} == {"tick", "frame"}
    assert {k for k in floors if "int8 weights" in k} == {k for k in result["stages"]["ms"]
                                                          if k.startswith("torch") and "int8 weights" in k}
    for key, f in floors.items():
        assert f["ratio_to_floor"] == round(result["stages"]["ms"][key] / f["floor_ms"], 2)
        assert f["samples"] == result["stages"]["rounds"]  # sampled in every round of the stages
    assert set(result["targets"]) == set(suite.TARGETS)
    for t in result["targets"].values():
        assert isinstance(t["met"], bool) and t["value"] is not None
    node = result["node"]["report"]
    assert node["frames_sent"] >= 30 and node["frames_processed"] > 0 and 0 < node["startup_s"] < 300
    assert result["targets"]["startup_s"]["value"] == node["startup_s"]
    md = (tmp_path / "bench" / "bench.md").read_text()
    for section in ("## Machine", "## Targets", "## Per frame on the clip", "floor of a reuse frame",
                    "## Stages against their floor", "## Node:", "How it is counted"):
        assert section in md
    assert all(name in md for name in suite.TARGETS)
    page = _Svgs()
    page.feed((tmp_path / "bench" / "bench.html").read_text())
    assert page.svgs == 4  # stages by backend, per frame, ratio to floor, the node run's latency distribution
    assert "bench all: wrote" in capsys.readouterr().out


def test_histogram_rows_count_every_latency():
    rows = histogram_rows([10.0, 11.0, 50.0, 90.0], bins=4)
    assert [n for _, n in rows] == [2.0, 0.0, 1.0, 1.0] and rows[0][0] == "10-30 ms"
    assert histogram_rows([]) == []


def test_bench_all_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="frames"):
        suite.run(tmp_path, frames=1)
    with pytest.raises(ValueError, match="drive"):
        suite.run(tmp_path, drive=str(tmp_path / "missing.mp4"))


def test_the_stage_rounds_run_in_changing_orders():
    """Each round runs every case once, in an order of its own that is the same in every run; over the rounds a case
    follows different cases (a fixed order put the floors' samples, or one backend's frame, before the same case every
    round)."""
    items = [("torch", "tick"), ("torch", "frame"), ("onnxruntime", "tick"), ("onnxruntime", "frame"), None]
    orders = [per_frame.round_order(items, index) for index in range(8)]
    assert all(sorted(o, key=str) == sorted(items, key=str) for o in orders)
    assert orders == [per_frame.round_order(items, index) for index in range(8)] and items[-1] is None
    before_tick = {o[o.index(("torch", "tick")) - 1] if o.index(("torch", "tick")) else "first" for o in orders}
    assert len(before_tick) >= 3
