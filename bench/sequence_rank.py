"""One process of a sample split over N (pipeline.sequence_parallel), emulated on one GPU, against the planner: a Wan
2.1 14B-width slice (`--blocks` blocks, LoRA r16 on a bf16 base, bf16 autocast) computing its 1/N of a clip's tokens
through diffpipe's own units and token shares (pipeline/sequence.py), each self-attention's Ulysses all-to-alls
replaced by copies of the bytes they move (the tensors laid out exactly as diffusers' `TemplatedUlyssesAttention`
lays them out, the collective a `clone`), and its backward computing the attention's forward again, as diffusers'
native attention op does under Ulysses. Time and peak memory per step against the planner's figures for that
process (the all-to-alls' link time is left out of both), at the plan's device speed: --tflops, or by default the
speed at which the plan times the unsplit process (--sp 1, the same slice and clip, measured first) as it ran, which
is how a plan is made for a device; so the check is of how the plan scales to a process's share.

    python bench/sequence_rank.py --sp 4 8 [--frames 21] [--size 60 104] [--blocks 4] [--steps 6] [--checkpointing]
    python bench/sequence_rank.py --sp 4 8 --size 90 160        # 720x1280, 81 frames: 75,600 tokens a clip
    python bench/sequence_rank.py --device cpu --preset digits --frames 4 --size 8 8 --sp 2 --steps 3   # a smoke run

Prints one JSON line: the plan's device speed (and whether measured on the unsplit process), measured median step
(after the first two) and peak allocated memory; planned step (forward + backward, less the all-to-alls) and peak;
their ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffpipe.build import build_backbone  # noqa: E402
from diffpipe.config_files import build_config  # noqa: E402
from diffpipe.models.families.wan.wan import WAN_PRESETS, WanFamily, wan_backbone  # noqa: E402
from diffpipe.models.lora import add_lora  # noqa: E402
from diffpipe.pipeline.sequence import SequenceShards, split_sequence  # noqa: E402
from diffpipe.planner.plan import hardware, make_plan  # noqa: E402


def _exchanged_in(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, tokens/n, heads, D) -> (B, tokens, heads/n, D): as diffusers' Ulysses lays it out, the all-to-all a copy."""
    b, s, h, d = x.shape
    x = x.reshape(b, s, n, h // n, d).permute(2, 1, 0, 3, 4).contiguous().clone()
    return x.flatten(0, 1).permute(1, 0, 2, 3).contiguous()


def _exchanged_out(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, tokens, heads/n, D) -> (B, tokens/n, heads, D), the way back."""
    b, s, h, d = x.shape
    x = x.reshape(b, n, s // n, h, d).permute(1, 3, 0, 2, 4).contiguous().clone()
    return x.flatten(0, 1).permute(1, 2, 0, 3).contiguous()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """WanAttnProcessor's rotary embedding."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
    out[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]
    return out.type_as(x)


class EmulatedUlysses:
    """WanAttnProcessor's self-attention as one of `n` processes runs it under Ulysses, alone on this device."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (q, k, v))
        q, k = _rotate(q, *rotary_emb), _rotate(k, *rotary_emb)
        q, k, v = (_exchanged_in(x, self.n) for x in (q, k, v))
        # diffusers' native op saves q, k, v and computes the attention again in backward: a checkpoint does the same
        out = checkpoint(_attend, q, k, v, use_reentrant=False) if torch.is_grad_enabled() else _attend(q, k, v)
        out = _exchanged_out(out, self.n).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def _config(args) -> dict:
    return {"model": {"architecture": "wan", "config": dict(WAN_PRESETS[args.preset], num_layers=args.blocks),
                      "text_max_length": args.text},
            "data": {"dataset": "synthetic", "frames": args.frames, "latent_size": list(args.size)},
            "train": {"batch_size": 1, "precision": "bf16", "device": args.device, "max_steps": args.steps},
            "adapter": {"type": "lora", "rank": 16, "alpha": 16.0},
            "memory": {"base_dtype": "bf16", "block_swap": 0, "optimizer_state": "fp32"},
            "pipeline": {"stages": 1, "microbatches": 1, "sequence_parallel": args.sp, "split": [],
                         "checkpointing": "all" if args.checkpointing else "none"},
            "plan": {"device_tflops": args.tflops, "link_gbps": 1e9}}  # the plan's all-to-alls at no cost: none here


def planned(args) -> tuple[float, float]:
    """The planner's (step seconds, peak bytes) for one process of the layout."""
    config = build_config(_config(args))
    meta = build_backbone(config, "meta")
    stage = make_plan(config, meta, 1, 1, 1, hardware(config), sequence_parallel=args.sp).planned.stages[0]
    return stage.forward_s + stage.backward_s - stage.exchange_s, stage.memory_bytes


def measured(args) -> tuple[list[float], float]:
    """Step seconds and peak bytes of the emulated process."""
    device = torch.device(args.device)
    config = build_config(_config(args))
    torch.manual_seed(0)
    family = WanFamily()
    model = family.model_class(**config.model.config).to(device)
    model.requires_grad_(False)
    add_lora(model, config.adapter, family.lora_targets, seed=0)
    for p in model.parameters():  # on the GPU the base in bf16, the adapters in fp32 (memory.base_dtype = "bf16")
        if not p.requires_grad and device.type == "cuda":
            p.data = p.data.to(torch.bfloat16)
    if args.sp > 1:  # the unsplit process attends as the model does (the plan recomputes no attention there)
        for block in model.blocks:
            block.attn1.set_processor(EmulatedUlysses(args.sp))
    backbone = split_sequence(wan_backbone(model), family.sequence_streams, SequenceShards(args.sp, 0))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=device.type == "cuda")
    sample = torch.randn(1, 16 if args.preset != "digits" else 1, args.frames, *args.size, device=device)
    conditions = {"timestep": torch.tensor([500.0], device=device),
                  "encoder_hidden_states": torch.randn(1, args.text, model.config.text_dim, device=device)}
    target = SequenceShards(args.sp, 0).shard(family.pack_prediction(model.config, torch.randn_like(sample)), 1)
    steps = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.steps):
        start = time.perf_counter()
        named = {"sample": sample, **conditions}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            for unit in backbone.units:
                reads = {n: named[n] for n in unit.reads}
                named.update(checkpoint(unit, reads, use_reentrant=False) if args.checkpointing else unit(named))
        F.mse_loss(named["prediction"].float(), target.float()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
    return steps, peak


def calibrated_tflops(args) -> float:
    """The device speed at which the plan times the unsplit process (sp 1) as it runs on this device."""
    whole = argparse.Namespace(**{**vars(args), "sp": 1, "tflops": 300.0})
    plan_s, _ = planned(whole)
    steps, _ = measured(whole)
    return whole.tflops * plan_s / statistics.median(steps[2:] or steps)


def report(args, calibrated: bool) -> None:
    """One degree's JSON line."""
    plan_s, plan_bytes = planned(args)
    steps, peak = measured(args)
    step = statistics.median(steps[2:] or steps)
    print(json.dumps({"sp": args.sp, "tflops": round(args.tflops, 1), "tflops_from_unsplit": calibrated,
                      "blocks": args.blocks, "frames": args.frames, "size": list(args.size),
                      "checkpointing": args.checkpointing, "measured_step_s": round(step, 4),
                      "planned_step_s": round(plan_s, 4), "step_ratio": round(step / plan_s, 3),
                      "measured_peak_gib": round(peak / 2**30, 2), "planned_peak_gib": round(plan_bytes / 2**30, 2),
                      "peak_ratio": round(peak / plan_bytes, 3)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, nargs="+", default=[4], help="the degrees (a line each)")
    parser.add_argument("--preset", default="t2v-14b")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--frames", type=int, default=21)
    parser.add_argument("--size", type=int, nargs=2, default=(60, 104))
    parser.add_argument("--text", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--tflops", type=float, help="the plan's device speed (plan.device_tflops); by default the "
                        "speed at which the plan times the unsplit process as it runs (measured first)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    calibrated = args.tflops is None
    if calibrated:
        args.tflops = calibrated_tflops(args)
    for degree in args.sp:
        report(argparse.Namespace(**{**vars(args), "sp": degree}), calibrated)


if __name__ == "__main__":
    main()
