"""A Z-Image-width slice on one GPU (issue 57): diffpipe (one stage) against a plain `ZImageTransformer2DModel`
training loop on the same slice; samples/s, model TFLOP/s and peak memory. Z-Image's width (3840, 30 heads of 128,
captions 2560 wide) with its two noise and two context refiners and fewer of its 30 main blocks, random weights,
1024x1024 pictures (128x128 latents of 16 channels in 2x2 patches: 4,096 picture tokens), captions of 128 tokens
(every position filled: no mask in either loop), fp32 weights, bf16 autocast, fused AdamW, gradients clipped to 1.0,
the whole batch as one micro-batch. The plain loop calls the model as ZImagePipeline does (lists of one-frame
latents and of captions, t = 1 - sigma) and trains its negated output to the velocity, as diffpipe does.

    python bench/z_image_slice.py [--blocks 6] [--batch 1] [--steps 6] [--checkpointing] [--only plain|diffpipe]
    python bench/z_image_slice.py --blocks 30 --lora 16 --base-dtype bf16 --steps 12   # the whole 6 B model
    python bench/z_image_slice.py --device cpu --preset digits --blocks 2 --steps 3    # a smoke run on the CPU

With --lora RANK both loops train a LoRA of that rank on to_q/to_k/to_v/to_out.0 over a base stored in --base-dtype
(the plain loop: peft's `inject_adapter_in_model`, the adapters in fp32).

Prints one JSON line per measurement: median step after the first two, samples/s, TFLOP/s (the FLOPs of one forward
counted by torch's FlopCounterMode on the meta device, times 3, over the median step) and the peak allocated memory.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffpipe.config_files import build_config  # noqa: E402
from diffpipe.distributed import single_process_topology  # noqa: E402
from diffpipe.models.families.z_image.z_image import Z_IMAGE_PRESETS  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402

TOKENS = 128  # caption tokens
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def _slice(args) -> dict:
    return dict(Z_IMAGE_PRESETS[args.preset], n_layers=args.blocks)


def _side(args) -> int:
    return 128 if args.preset == "6b" else 8  # a 1024x1024 picture's latents; the digits' 8x8


def _inputs(args, device: str) -> dict:
    """The model's inputs as ZImagePipeline gives them: lists of one-frame latents and of captions' states."""
    cfg, side = _slice(args), _side(args)
    return dict(x=[torch.randn(cfg["in_channels"], 1, side, side, device=device) for _ in range(args.batch)],
                t=torch.rand(args.batch, device=device),
                cap_feats=[torch.randn(TOKENS, cfg["cap_feat_dim"], device=device) for _ in range(args.batch)])


def step_flops(args) -> float:
    """One training step's FLOPs: the forward's, counted on the meta device (no memory, no time), times 3."""
    from diffusers import ZImageTransformer2DModel
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = ZImageTransformer2DModel(**_slice(args))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(**_inputs(args, "meta"), return_dict=False)
    return 3.0 * counter.get_total_flops()


def _peak_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None


def _report(what: str, args, steps: list[float], flops: float, **extra) -> None:
    median = statistics.median(steps[2:])
    print(json.dumps({"what": what, "blocks": args.blocks, "checkpointing": args.checkpointing, "batch": args.batch,
                      "lora": args.lora, "base_dtype": args.base_dtype, "median_step_s": round(median, 4),
                      "samples_per_s": round(args.batch / median, 3), "tflops": round(flops / median / 1e12, 1),
                      "peak_gib": _peak_gib(args.device), **extra}), flush=True)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def plain_loop(args, flops: float) -> None:
    """diffusers' model, its own forward, AdamW: the loop a user writes (peft's LoRA with --lora)."""
    from diffusers import ZImageTransformer2DModel

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.lora and args.base_dtype == "bf16" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random weights drawn on the device in the base's dtype, not copied there
    try:
        with torch.device(args.device):
            model = ZImageTransformer2DModel(**_slice(args)).train()
    finally:
        torch.set_default_dtype(default)
    if args.lora:
        from peft import LoraConfig, inject_adapter_in_model

        model.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=args.lora, lora_alpha=args.lora, target_modules=LORA_TARGETS), model)
        for p in model.parameters():  # peft makes adapters in the base's dtype; trained weights stay fp32
            if p.requires_grad:
                p.data = p.data.float()
    if args.checkpointing:
        model.enable_gradient_checkpointing()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-5, fused=args.device == "cuda")
    inputs = _inputs(args, args.device)
    target = torch.randn(args.batch, _slice(args)["in_channels"], 1, _side(args), _side(args), device=args.device)
    times = []
    for _ in range(args.steps):
        _synchronize(args.device)
        start = time.perf_counter()
        with torch.autocast(args.device, dtype=torch.bfloat16):
            out = torch.stack(model(**inputs, return_dict=False)[0])
        torch.nn.functional.mse_loss(-out.float(), target).backward()  # the velocity: the model's output negated
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _synchronize(args.device)
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    _report("plain ZImageTransformer2DModel loop", args, times, flops, params_B=round(params / 1e9, 2))


def diffpipe_run(args, flops: float) -> None:
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    table = {
        "model": {"architecture": "z_image", "config": _slice(args), "text_max_length": TOKENS},
        "data": {"dataset": "synthetic", "latent_size": [_side(args), _side(args)]},
        "train": {"max_steps": args.steps, "batch_size": args.batch, "learning_rate": 1e-5, "precision": "bf16",
                  "objective": "flow_matching", "device": args.device, "max_grad_norm": 1.0},
        "pipeline": {"stages": 1, "microbatches": 1, "checkpointing": "all" if args.checkpointing else "none"},
        "observe": {"every": 1000, "timeline_step": 0, "log_every": 0},
        "output": {"save_weights": False, "sample_every_end": False}, "checkpoint": {"every": 0},
        "memory": {"base_dtype": args.base_dtype}}
    if args.lora:
        table["adapter"] = {"type": "lora", "rank": args.lora, "alpha": float(args.lora), "target_modules": LORA_TARGETS}
    run_dir = Path(tempfile.mkdtemp())
    Trainer(build_config(table), single_process_topology(args.device), run_dir).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    _report("diffpipe z_image, one stage", args, [r["step_time_s"] for r in rows], flops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6, help="main blocks (of 30); the 4 refiners always")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--only", choices=["plain", "diffpipe"], default=None)
    parser.add_argument("--lora", type=int, default=None, metavar="RANK")
    parser.add_argument("--base-dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--preset", choices=sorted(Z_IMAGE_PRESETS), default="6b")
    args = parser.parse_args()
    if args.device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as bench/flux_slice.py: cuDNN's attention backward failed on H200
    flops = step_flops(args)
    if args.only != "diffpipe":
        plain_loop(args, flops)
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    if args.only != "plain":
        diffpipe_run(args, flops)


if __name__ == "__main__":
    main()
