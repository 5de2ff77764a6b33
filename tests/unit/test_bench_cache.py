"""`vla-node bench cache` end to end on the tiny preset: every figure the issue names is there, measured in one run,
with the weights each compute dtype gets by default."""

import json

import pytest

from vla_node.backends.fp16_weights import fp16_weights_available
from vla_node.backends.packed_weights import packed_weights_available
from vla_node.bench import cache as bench_cache
from vla_node.validate import ConfigError

KEYS = ("action_tick_ms", "action_tick_after_commit_ms", "vision_update_ms", "vision_update_with_tick_ms",
        "text_update_ms", "reference_step_ms", "hf_generate_ms", "kv_bytes", "vision_kv_bytes_fp16_equivalent")


def _run(tmp_path, compute_dtype):
    path = tmp_path / "cache.json"
    result = bench_cache.run("tiny", iters=1, json_path=str(path), compute_dtype=compute_dtype, deviation_frames=2,
                             policy_frames=2)
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    for key in KEYS:
        assert key in result, key
    assert set(result["kv_bytes"]) == {"text", "vision", "action"}
    assert all(result[key] > 0 for key in KEYS if key.endswith("_ms"))
    for row in result["vision_policies"]:  # vision + tick: the same work in every row
        assert row["step_ms"] > 0 and row["step_ms"] >= min(row["vision_update_ms"], row["action_tick_ms"])
    # the target's frame is the fused stage; the same work as two stages is reported beside it
    assert result["hf_generate_over_vision_update_plus_action_tick"] == round(
        result["hf_generate_ms"] / result["vision_update_with_tick_ms"], 2)
    assert result["hf_generate_over_separate_vision_update_and_tick"] == round(
        result["hf_generate_ms"] / (result["vision_update_ms"] + result["action_tick_after_commit_ms"]), 2)
    for key, target in result["targets"].items():
        assert target["met"] == (result[key] >= target["target"])
        rounds = target["per_round"]
        assert rounds["min"] <= rounds["median"] <= rounds["max"] and rounds["rounds"] == 1
        assert rounds["met_rounds"] == (rounds["median"] >= target["target"])  # one round: its ratio is the median
    return result


def test_per_round_ratio_sums_each_rounds_cases():
    timing = {"a": {"samples": [10.0, 30.0, 20.0]}, "b": {"samples": [1.0, 2.0, 4.0]},
              "c": {"samples": [1.0, 1.0, 1.0]}}
    ratios = bench_cache.per_round_ratio(timing, ("a",), ("b", "c"), target=5.0)  # 10/2, 30/3, 20/5
    assert ratios == {"min": 4.0, "median": 5.0, "max": 10.0, "met_rounds": 2, "rounds": 3}


@pytest.mark.skipif(not fp16_weights_available(), reason="fbgemm (x86-64) is not in this torch")
def test_fp32_compute_times_fp16_weights_against_plain_fp32_ones(tmp_path):
    result = _run(tmp_path, "fp32")
    assert (result["weights"], result["hf_weights"], result["plain_weights"]["weights"]) == ("fp16", "fp16", "fp32")
    assert result["linear_layers"] == {"policy": "Fp16WeightLinear", "reference": "Fp16WeightLinear",
                                       "plain weights": "Linear"}  # what really ran, not the labels


@pytest.mark.skipif(not packed_weights_available(),
                    reason="packed bf16 weights need oneDNN running bf16 in hardware (AVX512-BF16 or AMX, as ONEDNN_MAX_CPU_ISA allows)")
def test_bf16_compute_times_packed_weights_against_plain_bf16_ones_and_transformers_unpacked(tmp_path):
    result = _run(tmp_path, "bf16")
    assert (result["weights"], result["hf_weights"], result["plain_weights"]["weights"]) == ("packed", "bf16", "bf16")
    assert result["reference_dtype"] == result["hf_dtype"] == "bf16"
    assert result["linear_layers"] == {"policy": "PackedLinear", "reference": "PackedLinear", "plain weights": "Linear"}


def test_weights_that_do_not_fit_the_compute_dtype_are_named():
    with pytest.raises(ConfigError, match="weights = 'packed': expected 'fp32', 'fp16' with fp32 compute"):
        bench_cache.run("tiny", iters=1, compute_dtype="fp32", weights="packed")


def test_a_bench_refuses_the_flags_it_does_not_take(capsys):
    from vla_node.cli import main

    for argv, flag in ((["bench", "node", "--iters", "3"], "--iters"), (["bench", "model", "--weights", "fp16"],
                                                                          "--weights")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_bench_reuse_takes_every_flag_of_its_run_function(monkeypatch):
    """Every keyword of bench.reuse.run is a flag (the defaults are the function's own, written once)."""
    import inspect

    from vla_node.bench import reuse
    from vla_node.cli import build_parser

    params = set(inspect.signature(reuse.run).parameters)
    calls = []
    monkeypatch.setattr(reuse, "run", lambda *args, **kwargs: calls.append((args, kwargs)))
    args = build_parser().parse_args(["bench", "reuse", "a.mp4", "--thresholds", "1", "3", "--rates", "native", "5",
                                      "--max-frames", "4", "--cache", "exact", "--pixel-floor", "--weights", "fp32",
                                      "--layer-budget", "1.5", "--shared-drift-samples", "2", "--max-age", "3",
                                      "--threads", "1", "--preset", "tiny", "--json", "out.json"])
    args.func(args)
    (positional, kwargs), = calls
    assert positional == (["a.mp4"],)
    assert kwargs == {"preset": "tiny", "json_path": "out.json", "thresholds": [1.0, 3.0], "rates": ["native", 5.0],
                      "max_frames": 4, "cache": "exact", "pixel_floor": True, "weights": "fp32", "layer_budget": 1.5,
                      "shared_drift_samples": 2, "max_age": 3, "threads": 1}
    assert params - set(kwargs) == {"drives", "seed", "progress"}, params - set(kwargs)


def test_bench_model_runs_on_a_preset_with_a_short_text_partition(tmp_path):
    """tiny's text partition holds 23 bytes: bench model takes an instruction that fits it."""
    from vla_node.bench import model as bench_model

    result = bench_model.run("tiny", iters=1, iters_bf16=1, json_path=str(tmp_path / "model.json"))
    assert all(result[key] > 0 for key in ("reference_fp32_ms", "reference_bf16_ms", "hf_generate_ms"))


def test_a_benchs_preset_and_json_go_before_or_after_its_name_and_its_defaults_stay_its_own(monkeypatch, capsys):
    from vla_node.bench import model
    from vla_node.cli import build_parser, main

    calls = []
    monkeypatch.setattr(model, "run", lambda **kwargs: calls.append(kwargs))
    for argv in (["bench", "--preset", "tiny", "--json", "m.json", "model"],
                 ["bench", "model", "--preset", "tiny", "--json", "m.json"]):
        args = build_parser().parse_args(argv)
        args.func(args)
    args = build_parser().parse_args(["bench", "model"])
    args.func(args)
    assert calls == [{"preset_name": "tiny", "json_path": "m.json"}] * 2 + [{}]
    assert main(["bench", "attention", "--preset", "tiny"]) == 2
    assert "bench attention: --preset does not apply" in capsys.readouterr().err
