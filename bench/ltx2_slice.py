"""An LTX-2-width slice on one GPU (issue 57): diffpipe (one stage) against a plain `LTX2VideoTransformer3DModel`
training loop on the same slice; samples/s, model TFLOP/s and peak memory. LTX-2's width (video stream 4096 wide,
audio stream 2048, captions 3840 for each) with fewer of its 48 blocks, random weights, a 121-frame clip at 512x768
with its sound (16 latent frames of 16 x 24: 6,144 video tokens, 126 audio tokens, as LTX2Pipeline makes them),
captions of 1,024 positions (every one filled, no mask in either loop), bf16 autocast, fused AdamW, gradients clipped
to 1.0, the whole batch as one micro-batch. The plain loop calls the model as LTX2Pipeline does (the same timestep as
`timestep` and `sigma`) and trains both outputs to their targets, as diffpipe does.

    python bench/ltx2_slice.py [--blocks 4] [--batch 1] [--steps 8] [--lora 16 --base-dtype bf16] [--only plain|diffpipe]
    python bench/ltx2_slice.py --device cpu --preset digits --blocks 2 --steps 3    # a smoke run on the CPU
    python bench/ltx2_slice.py --blocks 8 --lora 16 --base-dtype bf16 --steps 6 --profile   # each under torch.profiler

Prints one JSON line per measurement (as bench/z_image_slice.py): median step after the first two, samples/s, TFLOP/s
(the FLOPs of one forward counted by torch's FlopCounterMode on the meta device, times 3) and the peak memory.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from z_image_slice import _report, _synchronize  # noqa: E402

from diffpipe.config_files import build_config  # noqa: E402
from diffpipe.distributed import single_process_topology  # noqa: E402
from diffpipe.models.families.ltx2.ltx2 import (LTX2_PRESETS, audio_latent_frames, caption_widths,  # noqa: E402
                                                video_coords, audio_coords)
from diffpipe.train.trainer import Trainer  # noqa: E402

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def _slice(args) -> dict:
    return dict(LTX2_PRESETS[args.preset], num_layers=args.blocks)


def _sizes(args) -> tuple[int, int, int, int]:
    """(video latent frames, height, width, caption positions): 121 frames at 512x768; the digits' 2 of 4 x 4."""
    return (16, 16, 24, 1024) if args.preset == "2.0" else (2, 4, 4, 8)


def _config(args):
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        return LTX2VideoTransformer3DModel(**_slice(args)).config


def _inputs(args, device: str) -> dict:
    cfg, (frames, height, width, text) = _config(args), _sizes(args)
    audio = audio_latent_frames(cfg, frames)
    video_width, audio_width = caption_widths(cfg)
    t = torch.rand(args.batch, device=device) * 1000
    return dict(hidden_states=torch.randn(args.batch, frames * height * width, cfg.in_channels, device=device),
                audio_hidden_states=torch.randn(args.batch, audio, cfg.audio_in_channels, device=device),
                encoder_hidden_states=torch.randn(args.batch, text, video_width, device=device),
                audio_encoder_hidden_states=torch.randn(args.batch, text, audio_width, device=device),
                timestep=t, sigma=t, video_coords=video_coords(cfg, args.batch, frames, height, width, device),
                audio_coords=audio_coords(cfg, args.batch, audio, device), return_dict=False)


def step_flops(args) -> float:
    from diffusers import LTX2VideoTransformer3DModel
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**_slice(args))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(**_inputs(args, "meta"))
    return 3.0 * counter.get_total_flops()


def plain_loop(args, flops: float) -> None:
    """diffusers' model, its own forward, AdamW: the loop a user writes (peft's LoRA with --lora)."""
    from diffusers import LTX2VideoTransformer3DModel

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.lora and args.base_dtype == "bf16" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random weights drawn on the device in the base's dtype, not copied there
    try:
        with torch.device(args.device):
            model = LTX2VideoTransformer3DModel(**_slice(args)).train()
    finally:
        torch.set_default_dtype(default)
    if args.lora:
        from peft import LoraConfig, inject_adapter_in_model

        model.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=args.lora, lora_alpha=args.lora, target_modules=LORA_TARGETS), model)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-5, fused=args.device == "cuda")
    inputs = _inputs(args, args.device)
    target = torch.randn(args.batch, inputs["hidden_states"].shape[1] + inputs["audio_hidden_states"].shape[1],
                         inputs["hidden_states"].shape[2], device=args.device)
    times = []
    for _ in range(args.steps):
        _synchronize(args.device)
        start = time.perf_counter()
        with torch.autocast(args.device, dtype=torch.bfloat16):
            out = torch.cat(model(**inputs), dim=1)
        torch.nn.functional.mse_loss(out.float(), target).backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _synchronize(args.device)
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    _report("plain LTX2VideoTransformer3DModel loop", args, times, flops, params_B=round(params / 1e9, 2))


def diffpipe_run(args, flops: float) -> None:
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    frames, height, width, text = _sizes(args)
    table = {
        "model": {"architecture": "ltx2", "config": _slice(args), "text_max_length": text},
        "data": {"dataset": "synthetic", "latent_size": [height, width], "frames": frames},
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
    _report("diffpipe ltx2, one stage", args, [r["step_time_s"] for r in rows], flops)


def profiled(what: str, run, top: int = 12) -> None:
    """`run()` under torch.profiler: one JSON line of the device time of every kernel and op and the `top` ones
    (name, milliseconds, calls), to tell a GPU difference from a host one."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    rows = sorted(((e.self_device_time_total / 1e3, e.count, e.key) for e in prof.key_averages()
                   if e.self_device_time_total > 0), reverse=True)
    print(json.dumps({"what": f"profile: {what}", "device_ms": round(sum(r[0] for r in rows), 1),
                      "top": [[name[:90], round(ms, 1), calls] for ms, calls, name in rows[:top]]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4, help="blocks (of 48)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--only", choices=["plain", "diffpipe"], default=None)
    parser.add_argument("--lora", type=int, default=None, metavar="RANK")
    parser.add_argument("--base-dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--preset", choices=sorted(LTX2_PRESETS), default="2.0")
    parser.add_argument("--profile", action="store_true", help="each run under torch.profiler, its top kernels printed")
    args = parser.parse_args()
    flops = step_flops(args)
    runs = [("plain", plain_loop), ("diffpipe", diffpipe_run)]
    for name, run in [(name, run) for name, run in runs if args.only in (None, name)]:
        if args.profile:
            profiled(name, lambda: run(args, flops))
        else:
            run(args, flops)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
