"""A Qwen-Image-width slice on one GPU: diffpipe (one stage) against a plain `QwenImageTransformer2DModel` training
loop on the same slice; samples/s, model TFLOP/s and peak memory. Qwen-Image's width (3072, 24 heads of 128, text
3584 wide) with fewer of its 60 blocks, random weights, 1024x1024 pictures (128x128 latents packed 2x2: 4,096 image
tokens), captions of 128 tokens (every position filled: the plain loop passes no mask, as QwenImagePipeline then
does, and diffpipe's text is cut to 128 unmasked), fp32 weights, bf16 autocast, fused AdamW, the whole batch as one
micro-batch.

    python bench/qwen_image_slice.py [--blocks 6] [--batch 1] [--steps 6] [--checkpointing] [--only plain|diffpipe]

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
from diffpipe.models.qwen_image import QWEN_IMAGE_PRESETS  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402

TOKENS, SIDE = 128, 128  # text tokens; latent side of a 1024x1024 picture


def _slice(args) -> dict:
    return dict(QWEN_IMAGE_PRESETS["20b"], num_layers=args.blocks)


def _inputs(args, device: str = "cuda") -> dict:
    on = dict(device=device)
    return dict(hidden_states=torch.randn(args.batch, (SIDE // 2) ** 2, 64, **on),
                timestep=torch.rand(args.batch, **on),
                encoder_hidden_states=torch.randn(args.batch, TOKENS, 3584, **on),
                img_shapes=[[(1, SIDE // 2, SIDE // 2)]] * args.batch)


def step_flops(args) -> float:
    """One training step's FLOPs: the forward's, counted on the meta device (no memory, no time), times 3."""
    from diffusers import QwenImageTransformer2DModel
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**_slice(args))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(**_inputs(args, "meta"), return_dict=False)
    return 3.0 * counter.get_total_flops()


def _report(what: str, args, steps: list[float], flops: float, **extra) -> None:
    median = statistics.median(steps[2:])
    print(json.dumps({"what": what, "blocks": args.blocks, "checkpointing": args.checkpointing, "batch": args.batch,
                      "text_tokens": TOKENS, "median_step_s": round(median, 4),
                      "samples_per_s": round(args.batch / median, 3), "tflops": round(flops / median / 1e12, 1),
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), **extra}), flush=True)


def plain_loop(args, flops: float) -> None:
    """diffusers' model, its own forward, AdamW: the loop a user writes."""
    from diffusers import QwenImageTransformer2DModel

    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**_slice(args)).to("cuda").train()
    if args.checkpointing:
        model.enable_gradient_checkpointing()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    inputs = _inputs(args)
    target = torch.randn(args.batch, (SIDE // 2) ** 2, 64, device="cuda")
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**inputs, return_dict=False)[0]
        torch.nn.functional.mse_loss(out.float(), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    _report("plain QwenImageTransformer2DModel loop", args, times, flops, params_B=round(params / 1e9, 2))


def diffpipe_run(args, flops: float) -> None:
    torch.cuda.reset_peak_memory_stats()
    config = build_config({
        "model": {"architecture": "qwen_image", "config": _slice(args), "text_max_length": TOKENS},
        "data": {"dataset": "synthetic", "latent_size": [SIDE, SIDE]},
        "train": {"max_steps": args.steps, "batch_size": args.batch, "learning_rate": 1e-5, "precision": "bf16",
                  "objective": "flow_matching", "device": "cuda"},
        "pipeline": {"stages": 1, "microbatches": 1, "checkpointing": "all" if args.checkpointing else "none"},
        "observe": {"every": 1000, "timeline_step": 0, "log_every": 0},
        "output": {"save_weights": False, "sample_every_end": False}, "checkpoint": {"every": 0}})
    run_dir = Path(tempfile.mkdtemp())
    Trainer(config, single_process_topology("cuda"), run_dir).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    _report("diffpipe, one stage", args, [r["step_time_s"] for r in rows], flops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--only", choices=["plain", "diffpipe"], default=None)
    args = parser.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)  # as bench/flux_slice.py: cuDNN's attention backward failed on H200
    flops = step_flops(args)
    if args.only != "diffpipe":
        plain_loop(args, flops)
    gc.collect()
    torch.cuda.empty_cache()
    if args.only != "plain":
        diffpipe_run(args, flops)


if __name__ == "__main__":
    main()
