"""The partial tower step: equal (fp32, to float rounding) to VisionTokenCache.refresh of every camera in the node's
default configuration (attend_all, no drift gates; shared drift samples 8, a few, or 0), driven through a first full
frame and then frames whose pixels change on some tokens; a full refresh equal to the plain tower; exported to ONNX
at opset <= 20 and ONNX Runtime equal to torch; the host's row helper."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vla_node.backends.export import export_step
from vla_node.backends.tower_partial_step import TOWER_INPUTS, TOWER_OUTPUTS, TowerPartialStep, tower_rows
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.vision_cache import VisionTokenCache, shared_sample

CONFIGS = {"tiny": preset("tiny"), "tiny64": preset("tiny").replace(image_size=64), "small": preset("small")}
# per config, the tokens that change per camera in frames 1.. (frame 0 is full): one camera unchanged in some
CHANGES = {"tiny": [(1, 0), (1, 2), (0, 1)], "tiny64": [(3, 0), (2, 5), (0, 4)], "small": [(10, 0), (6, 25), (0, 3)]}
STATE = ("out", "x_ref", "q", "k", "v", "attn_out", "mlp_out")  # the cache's tensors, in TOWER_OUTPUTS' order


def cache_state(cache: VisionTokenCache) -> tuple[torch.Tensor, ...]:
    """The cache's live state as the step's outputs read it (x_ref: layer 0's only)."""
    return tuple(getattr(cache, name)[:, 0] if name == "x_ref" else getattr(cache, name) for name in STATE)


def change_patches(pixels: torch.Tensor, camera: int, tokens: torch.Tensor, patch: int, g: torch.Generator) -> None:
    grid = pixels.shape[-1] // patch
    for token in tokens.tolist():
        y, x = divmod(token, grid)
        pixels[camera, :, y * patch : (y + 1) * patch, x * patch : (x + 1) * patch] = \
            torch.rand(3, patch, patch, generator=g) * 2 - 1


def drive(name: str, samples: int, partial_frames: int | None = None):
    """Two cameras through the cache: a full frame, then CHANGES[name] (the first `partial_frames`). Per frame:
    (gate tokens per camera, the step's inputs (the cache's live state before the refresh), the cache's committed
    state after it)."""
    config = CONFIGS[name]
    model = build_vla(config, seed=0)
    T, P, S = config.tokens_per_camera, config.patch_size, config.image_size
    cameras = 2
    cache = VisionTokenCache(model.vision, cameras, shared_drift_samples=samples)
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(cameras, 3, S, S, generator=g) * 2 - 1
    frames = []
    for counts in [None] + CHANGES[name][:partial_frames]:
        tokens: list[torch.Tensor | None] = [None] * cameras
        if counts is not None:
            tokens = [torch.randperm(T, generator=g)[:n].sort().values for n in counts]
            for camera, t in enumerate(tokens):
                change_patches(pixels, camera, t, P, g)
        _, x0, q, k, v, attn_out, mlp_out = (t.clone() for t in cache_state(cache))
        with torch.inference_mode():
            for camera in range(cameras):
                cache.refresh(camera, pixels[camera], tokens[camera])
            cache.commit()
        frames.append((tokens, (pixels.clone(), x0, q, k, v, attn_out, mlp_out),
                       tuple(t.clone() for t in cache_state(cache))))
    return model, frames


def step_inputs(state: tuple[torch.Tensor, ...], tokens, T: int, capacity: int, samples: int) -> dict:
    pixels, *cached = state
    rows, sample_at, sample_weight = tower_rows(tokens, T, capacity, samples)
    return dict(zip(TOWER_INPUTS, (pixels, rows, sample_at, sample_weight, *cached)))


def capacity_for(name: str, samples: int) -> int:
    """Room for every frame's rows, with padding (but at most T)."""
    T = CONFIGS[name].tokens_per_camera
    return min(T, max(max(counts) for counts in CHANGES[name]) + samples + 3)


def assert_close(got: torch.Tensor, expected: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    """fp32 to float rounding, relative to the magnitude (GEMM blocking differs between row counts)."""
    scale = max(expected.abs().max().item(), 1e-30)
    err = (got - expected).abs().max().item()
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} over magnitude {scale:.3g}"


@pytest.mark.parametrize("name,samples", [("tiny", 8), ("tiny", 2), ("tiny", 0), ("tiny64", 8), ("tiny64", 0),
                                          ("small", 8), ("small", 0)])
def test_the_step_equals_the_tower_caches_refresh_of_every_camera(name, samples):
    """Frame 0 full (K = T), then partial frames at a capacity with padding: two cameras with different changed
    counts, one unchanged (all its rows padding: it comes out as its cached state)."""
    model, frames = drive(name, samples)
    T = model.config.tokens_per_camera
    partial = TowerPartialStep(model, capacity_for(name, samples), samples).eval()
    full = TowerPartialStep(model, T, samples).eval()
    for f, (tokens, state, expected) in enumerate(frames):
        step = full if f == 0 else partial
        inputs = step_inputs(state, tokens, T, step.capacity, samples)
        with torch.inference_mode():
            got = step(*inputs.values())
        for camera, gate in enumerate(tokens):
            for out, got_t, exp_t in zip(TOWER_OUTPUTS, got, expected):
                assert got_t.shape == exp_t.shape, out
                assert_close(got_t[camera], exp_t[camera], f"frame {f} camera {camera} {out}")
            if gate is not None and gate.numel() == 0:  # unchanged: its cached state, as it was
                for out, got_t, cached in zip(TOWER_OUTPUTS[1:], got[1:], list(inputs.values())[4:]):
                    assert_close(got_t[camera], cached[camera], f"frame {f} camera {camera} {out} (unchanged)")


def test_the_oracle_is_not_vacuous():
    """With shared drift, a partial frame's outputs (small, every camera changed) differ from the plain tower's
    and from those of a step that ignores the sample by far more than the tolerance: the step follows the cache."""
    model, frames = drive("small", 8, partial_frames=2)
    tokens, state, expected = frames[2]
    step = TowerPartialStep(model, capacity_for("small", 8), 8).eval()
    inputs = step_inputs(state, tokens, model.config.tokens_per_camera, step.capacity, 8)
    with torch.inference_mode():
        out = step(*inputs.values())[0]
        plain = model.vision(state[0])
        no_sample = step(*{**inputs, "sample_weight": torch.zeros_like(inputs["sample_weight"])}.values())[0]
    assert_close(out, expected[0], "out")
    scale = plain.abs().max().item()
    for other in (plain, no_sample):
        assert (out - other).abs().amax(dim=(1, 2)).min().item() > 1e-3 * scale


@pytest.mark.parametrize("name,samples", [("tiny", 8), ("small", 8), ("small", 0)])
def test_a_full_refresh_equals_the_plain_tower_whatever_the_cache_holds(name, samples):
    """K = T, rows = arange(T), no sample: the first frame, equal to VisionTokenCache.refresh(cam, pixels, None)
    and to model.vision(pixels); the cached inputs (here random) do not matter."""
    config = CONFIGS[name]
    model = build_vla(config, seed=0)
    T, W, L, H = config.tokens_per_camera, config.vision_width, config.vision_layers, config.vision_heads
    g = torch.Generator().manual_seed(3)
    pixels = torch.rand(2, 3, config.image_size, config.image_size, generator=g) * 2 - 1
    rows, sample_at, sample_weight = tower_rows([None, None], T, T, samples)
    assert rows.tolist() == [list(range(T))] * 2 and not sample_weight.any()
    cached = [torch.randn(2, *shape, generator=g) for shape in
              ((T, W), (L, H, T, W // H), (L, H, T, W // H), (L, H, T, W // H), (L, T, W), (L, T, W))]
    cache = VisionTokenCache(model.vision, 2, shared_drift_samples=samples)
    with torch.inference_mode():
        got = TowerPartialStep(model, T, samples).eval()(pixels, rows, sample_at, sample_weight, *cached)
        for camera in range(2):
            cache.refresh(camera, pixels[camera], None)
        cache.commit()
        plain = model.vision(pixels)
    assert_close(got[0], plain, "out vs the plain tower")
    for out, got_t, exp_t in zip(TOWER_OUTPUTS, got, cache_state(cache)):
        assert_close(got_t, exp_t, f"{out} vs the cache's full refresh")


@pytest.mark.parametrize("name,samples", [("tiny", 8), ("tiny64", 0), ("small", 8)])
def test_the_exported_step_runs_in_onnx_runtime_as_in_torch(tmp_path, name, samples):
    """A partial frame (one camera changed, one not; capacity with padding), exported with dynamo at opset 20."""
    onnx = pytest.importorskip("onnx", reason="onnx checks the exported graph")
    pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle of the exported graph")
    model, frames = drive(name, samples, partial_frames=1)
    tokens, state, _ = frames[1]
    capacity = capacity_for(name, samples)
    inputs = step_inputs(state, tokens, model.config.tokens_per_camera, capacity, samples)
    sidecar = export_step(TowerPartialStep(model, capacity, samples), inputs, TOWER_OUTPUTS,
                          tmp_path / "tower.onnx")
    assert sidecar["opset"] <= 20
    assert [i["name"] for i in sidecar["inputs"]] == list(TOWER_INPUTS)
    assert [o["name"] for o in sidecar["outputs"]] == list(TOWER_OUTPUTS)
    for out, figures in sidecar["parity_onnxruntime_vs_torch"].items():
        assert figures["max_rel"] <= 1e-4, (out, figures)
    graph = onnx.load(str(tmp_path / "tower.onnx"))
    assert max(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")) <= 20
    ops = {n.op_type for n in graph.graph.node}
    assert not ops & {"Attention", "ScaledDotProductAttention", "NonZero", "If", "Loop"}, ops


def test_tower_rows_picks_the_caches_sample_and_pads():
    T, samples = 16, 4
    gate = torch.tensor([9, 2, 5])
    rows, sample_at, sample_weight = tower_rows([gate, None, torch.zeros(0, dtype=torch.long)], T, T, samples)
    expected_rows, sample = shared_sample(gate.sort().values, samples, torch.zeros(T, dtype=torch.bool))
    n = expected_rows.numel()
    assert rows[0, :n].tolist() == expected_rows.tolist() and (rows[0, n:] == T).all()
    assert rows[0, sample_at[0, : sample.numel()]].tolist() == sample.tolist()
    weights = [1 / sample.numel()] * sample.numel() + [0.0] * (samples - sample.numel())  # the sample's mean
    np.testing.assert_allclose(sample_weight[0].numpy(), weights)
    assert rows[1].tolist() == list(range(T)) and not sample_weight[1].any()  # None: every token, no sample
    assert (rows[2] == T).all() and not sample_weight[2].any()  # nothing changed: all padding
    rows, sample_at, sample_weight = tower_rows([gate], T, 3, 0)  # no shared drift: the gate alone
    assert rows.tolist() == [[2, 5, 9]] and sample_at.shape == sample_weight.shape == (1, 1)
    assert not sample_weight.any()


def test_tower_rows_refuses_more_rows_than_the_capacity_naming_the_camera_and_counts():
    T = 16
    fits = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"camera 1: 3 gate rows \+ 4 sample rows = 7 exceed the step's capacity 6"):
        tower_rows([fits, torch.tensor([3, 7, 11])], T, 6, 4)
    with pytest.raises(ValueError, match=r"camera 0: 16 gate rows \+ 0 sample rows = 16 exceed the step's capacity 8"):
        tower_rows([None], T, 8, 4)
    with pytest.raises(ValueError, match="camera 0: token 16 is out of range for 16 tokens"):
        tower_rows([torch.tensor([1, 16])], T, 8, 0)
