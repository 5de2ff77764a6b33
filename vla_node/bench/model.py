"""`vla-node bench model`: per-frame latency of the reference path (fp32 and bf16) side by side with
transformers' `generate` on the same decoder weights and the same input tokens."""

from __future__ import annotations

import copy
import json
import platform
import tempfile
from typing import Callable

import numpy as np
import torch

from vla_node.backends.fp16_weights import use_fp16_weights
from vla_node.bench.timing import time_ms
from vla_node.drives.synthetic import SyntheticDriveConfig, synthetic_frames
from vla_node.model.checkpoint import save_checkpoint
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.runtime.reference import ReferencePolicy

INSTRUCTION = "keep the lane, follow the car ahead"
SHORT_INSTRUCTION = "keep lane, follow car"  # for presets whose text partition is shorter (tiny: 23 bytes)


def hf_generate_ms(model, policy: ReferencePolicy, frame: np.ndarray, iters: int,
                   instruction: str = INSTRUCTION, fp16_weights: bool = False,
                   dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Time hf_generate_step (below) `iters` times."""
    return time_ms(hf_generate_step(model, policy, frame, instruction, fp16_weights, dtype), iters)


def hf_generate_step(model, policy: ReferencePolicy, frame: np.ndarray, instruction: str = INSTRUCTION,
                     fp16_weights: bool = False, dtype: torch.dtype = torch.float32) -> Callable[[], None]:
    """hf_peer (below) on one fixed frame."""
    peer = hf_peer(model, policy, instruction, fp16_weights, dtype)
    return lambda: peer(frame)


def hf_peer(model, policy: ReferencePolicy, instruction: str = INSTRUCTION, fp16_weights: bool = False,
            dtype: torch.dtype = torch.float32) -> Callable[[np.ndarray], None]:
    """One frame through transformers on our checkpoint: SiglipVisionModel on the frame's pixels, our projector
    (and camera embedding), then LlamaForCausalLM.generate of H*D new tokens after the prefix embeddings (text,
    vision, state), greedy, its default dynamic cache. `model` is fp32; with fp16_weights transformers' models and
    the model computing the rest of the prefix get fp16 linear weights (the same swap as ours), with dtype bf16 all
    compute in bf16, so that the comparison is at one precision. Returns run(frame uint8 [H, W, 3])."""
    import transformers

    c = model.config
    with tempfile.TemporaryDirectory() as tmp:
        path = save_checkpoint(model, tmp)
        hf = transformers.LlamaForCausalLM.from_pretrained(str(path / "decoder"), dtype=dtype).eval()
        siglip = transformers.SiglipVisionModel.from_pretrained(str(path / "vision"), dtype=dtype).eval()
    if fp16_weights:
        model, hf, siglip = (use_fp16_weights(copy.deepcopy(model)), use_fp16_weights(hf),
                             use_fp16_weights(siglip))
    elif dtype != torch.float32:
        model = copy.deepcopy(model).to(dtype)
    from vla_node.model.tokenizer import encode

    ids = torch.tensor(encode(instruction, c.max_text_tokens))

    def run(frame: np.ndarray) -> None:
        with torch.inference_mode():
            pixels = policy.prepare_frames([frame]).to(dtype)  # [C, 3, S, S]
            vision = siglip(pixel_values=pixels).last_hidden_state  # [C, T, vision_width]
            prefix = torch.cat([model.embed_text(ids), model.project_vision(vision),  # [C*T, hidden]
                                model.embed_state(torch.zeros(c.state_dim, dtype=dtype))])
            hf.generate(inputs_embeds=prefix[None], max_new_tokens=c.action_tokens, min_new_tokens=c.action_tokens,
                        do_sample=False, pad_token_id=258)

    return run


def run(preset_name: str = "small", iters: int = 5, iters_bf16: int = 2, threads: int = 1,
        json_path: str | None = None) -> dict:
    if threads:
        torch.set_num_threads(threads)
    config = preset(preset_name)
    instruction = INSTRUCTION if len(INSTRUCTION.encode()) < config.max_text_tokens else SHORT_INSTRUCTION  # + BOS
    frame = next(iter(synthetic_frames(SyntheticDriveConfig(width=640, height=480, fps=10, seconds=1, seed=0))))[1]
    state = np.zeros(config.state_dim, np.float32)
    results: dict = {"preset": preset_name, "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine()}
    for key, dtype, n in (("reference_fp32_ms", torch.float32, iters), ("reference_bf16_ms", torch.bfloat16, iters_bf16)):
        policy = ReferencePolicy(build_vla(config, seed=0), dtype=dtype)
        timing = time_ms(lambda: policy.step([frame], instruction, state), n)
        results[key] = round(timing["median"], 2)
        print(f"{key:20s} {timing['median']:9.1f} ms  (min {timing['min']:.1f}, max {timing['max']:.1f}, n={n})", flush=True)
    model = build_vla(config, seed=0)
    timing = hf_generate_ms(model, ReferencePolicy(model), frame, iters, instruction)
    results["hf_generate_ms"] = round(timing["median"], 2)
    print(f"{'hf_generate_ms':20s} {timing['median']:9.1f} ms  (min {timing['min']:.1f}, max {timing['max']:.1f}, n={iters})")
    results["ratio_hf_over_reference_fp32"] = round(results["hf_generate_ms"] / results["reference_fp32_ms"], 3)
    results["ratio_bf16_over_fp32"] = round(results["reference_bf16_ms"] / results["reference_fp32_ms"], 3)
    print(f"hf_generate / reference_fp32 = {results['ratio_hf_over_reference_fp32']:.2f}x; "
          f"reference bf16 / fp32 = {results['ratio_bf16_over_fp32']:.2f}x")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    return results
