"""A HunyuanVideo 1.5-width slice on one GPU: diffpipe (one stage) against a plain `HunyuanVideo15Transformer3DModel`
training loop on the same slice; video frames/s, model TFLOP/s and peak memory. The 480p text-to-video release's
width (2048, 16 heads of 128, Qwen2.5-VL width 3584, ByT5 width 1472) with fewer blocks, random weights, 480x848 clips
of 33 or 121 video frames (9 or 31 latent frames of 30x53: 14,310 or 49,290 tokens), a caption of `--text` Qwen
positions (no quoted text), fp32 weights, bf16 autocast, fused AdamW, the whole batch as one micro-batch.

    python bench/hunyuan_video15_slice.py [--blocks 4] [--frames 9] [--text 256] [--batch 1] [--steps 6]

The plain loop feeds the model as HunyuanVideo15Pipeline does: Qwen's 1,000 positions and ByT5's 256 with their
masks, zero image embeddings (729 masked tokens), so its processor builds a sequence x sequence mask; diffpipe feeds
the caption cut to 256 positions, its ByT5 stream filled (synthetic text fills every position), masked as keys.

Prints one JSON line per measurement: median step after the first two, video frames/s, TFLOP/s (the FLOPs of
diffpipe's forward over the video and text tokens it attends to, counted by torch's FlopCounterMode on the meta
device, times 3, over the median step) and the peak allocated memory.
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
from diffpipe.models.families.hunyuan_video15.hunyuan_video15 import HUNYUAN_VIDEO15_PRESETS, HunyuanVideo15Family  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402

HEIGHT, WIDTH = 30, 53  # latent rows and columns of a 480x848 clip


def _slice(args) -> dict:
    return dict(HUNYUAN_VIDEO15_PRESETS["480p-t2v"], num_layers=args.blocks)


def _pipeline_inputs(args, device: str = "cuda") -> dict:
    """What HunyuanVideo15Pipeline feeds the transformer for a caption of `args.text` Qwen positions and no quoted
    text: 65 channels (latents, zero condition latents, a zero mask), padded text with masks, zero image embeddings."""
    on = dict(device=device)
    cfg = _slice(args)
    mask = torch.arange(1000, **on)[None, :].expand(args.batch, -1) < args.text
    return dict(hidden_states=torch.randn(args.batch, cfg["in_channels"], args.frames, HEIGHT, WIDTH, **on),
                timestep=torch.rand(args.batch, **on) * 1000,
                encoder_hidden_states=torch.randn(args.batch, 1000, cfg["text_embed_dim"], **on) * mask[..., None],
                encoder_attention_mask=mask.long(),
                encoder_hidden_states_2=torch.zeros(args.batch, 256, cfg["text_embed_2_dim"], **on),
                encoder_attention_mask_2=torch.zeros(args.batch, 256, dtype=torch.long, **on),
                image_embeds=torch.zeros(args.batch, 729, cfg["image_embed_dim"], **on))


def step_flops(args) -> float:
    """One training step's FLOPs: diffpipe's forward (video tokens and the 2 x `text` text tokens it attends to),
    counted on the meta device, times 3."""
    from torch.utils.flop_counter import FlopCounterMode

    family = HunyuanVideo15Family()
    with torch.device("meta"):
        model = family.model_class(**_slice(args))
        backbone = family.describe(model, "layers")
        cfg = model.config
        conditions = {"timestep": torch.zeros(args.batch),
                      "encoder_hidden_states": torch.zeros(args.batch, args.text, cfg.text_embed_dim),
                      "encoder_attention_mask": torch.zeros(args.batch, 0, dtype=torch.bool),
                      "encoder_hidden_states_2": torch.zeros(args.batch, args.text, cfg.text_embed_2_dim),
                      "encoder_attention_mask_2": torch.zeros(args.batch, 0, dtype=torch.bool),
                      "rotary": torch.zeros(args.batch, 2, args.frames * HEIGHT * WIDTH, cfg.attention_head_dim)}
        sample = torch.zeros(args.batch, cfg.out_channels, args.frames, HEIGHT, WIDTH)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        backbone.forward({"sample": sample}, conditions)
    return 3.0 * counter.get_total_flops()


def _report(what: str, args, steps: list[float], flops: float, **extra) -> None:
    median = statistics.median(steps[2:])
    video_frames = args.batch * (4 * args.frames - 3)
    print(json.dumps({"what": what, "blocks": args.blocks, "latent_frames": args.frames,
                      "video_frames": 4 * args.frames - 3, "text": args.text, "batch": args.batch,
                      "median_step_s": round(median, 4), "video_frames_per_s": round(video_frames / median, 2),
                      "tflops": round(flops / median / 1e12, 1),
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), **extra}), flush=True)


def plain_loop(args, flops: float) -> None:
    """diffusers' model, its own forward, AdamW: the loop a user writes."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = HunyuanVideo15Transformer3DModel(**_slice(args)).to("cuda").train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    inputs = _pipeline_inputs(args)
    target = torch.randn_like(inputs["hidden_states"][:, :_slice(args)["out_channels"]])
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
    _report("plain HunyuanVideo15Transformer3DModel loop", args, times, flops, params_B=round(params / 1e9, 2))


def diffpipe_run(args, flops: float) -> None:
    torch.cuda.reset_peak_memory_stats()
    config = build_config({
        "model": {"architecture": "hunyuan_video15", "config": _slice(args), "text_max_length": args.text},
        "data": {"dataset": "synthetic", "frames": args.frames, "latent_size": [HEIGHT, WIDTH]},
        "train": {"max_steps": args.steps, "batch_size": args.batch, "learning_rate": 1e-5, "precision": "bf16",
                  "objective": "flow_matching", "device": "cuda"},
        "pipeline": {"stages": 1, "microbatches": 1, "checkpointing": "none"},
        "observe": {"every": 1000, "timeline_step": 0, "log_every": 0},
        "output": {"save_weights": False, "sample_every_end": False}, "checkpoint": {"every": 0}})
    run_dir = Path(tempfile.mkdtemp())
    Trainer(config, single_process_topology("cuda"), run_dir).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    _report("diffpipe, one stage", args, [r["step_time_s"] for r in rows], flops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--frames", type=int, default=9, help="latent frames (9: 33 video frames; 31: 121)")
    parser.add_argument("--text", type=int, default=256, help="the caption's Qwen positions")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", choices=["plain", "diffpipe"], default=None)
    args = parser.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)  # as bench/flux_slice.py: cuDNN's attention backward failed on H200
    flops = step_flops(args)
    if args.only != "diffpipe":
        try:
            plain_loop(args, flops)
        except torch.OutOfMemoryError as exc:  # its sequence x sequence mask: 2.4 GiB a sample at 121 frames
            print(json.dumps({"what": "plain HunyuanVideo15Transformer3DModel loop", "error": str(exc)[:200]}))
    gc.collect()
    torch.cuda.empty_cache()
    if args.only != "plain":
        diffpipe_run(args, flops)


if __name__ == "__main__":
    main()
