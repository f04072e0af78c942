"""A Wan-width video slice on one GPU: diffpipe (one stage) against a plain `WanTransformer3DModel` training loop on
the same slice; frames/s, model TFLOP/s and peak memory. Wan 2.1 14B's width (5120, 40 heads of 128, ffn 13824, umT5
width 4096) with fewer blocks (or the whole 1.3B model: `--preset t2v-1.3b --blocks 30`), random weights, 832x480
clips of 33 or 81 video frames (9 or 21 latent frames through Wan's VAE: 14,040 or 32,760 tokens), 512 text tokens,
fp32 weights, bf16 autocast, fused AdamW, the whole batch as one micro-batch.

    python bench/wan_slice.py [--preset t2v-14b] [--blocks 4] [--frames 21] [--batch 1] [--steps 6] [--checkpointing]
    python bench/wan_slice.py --preset i2v-a14b ...   # image-to-video (Wan 2.2 I2V-A14B's expert): 36 input channels
    python bench/wan_slice.py --preset ti2v-5b --frames 31 ...  # TI2V-5B's image-to-video at 704x1280, 121 frames
    python bench/wan_slice.py --preset i2v-14b ...    # Wan 2.1 I2V-14B: also 257 CLIP tokens of the picture
    python bench/wan_slice.py --both ...              # Wan 2.2 A14B's two experts: each step the one its timestep picks

TI2V-5B's image-to-video (`--preset ti2v-5b`: 48 channels through Wan 2.2's 16x VAE, 704x1280, 44x80 latents) feeds
the plain loop what WanImageToVideoPipeline feeds that model: a timestep per token, zero on the first latent frame
(diffusers then modulates token by token); diffpipe embeds one a latent frame (models/families/wan/ti2v.py). Wan 2.1
I2V-14B (`--preset i2v-14b`) also reads a picture's 257 CLIP states (1280 wide) before the text: random ones in the
plain loop, the stand-in text encoder's pooled output in diffpipe's (models/families/wan/clip.py). `--both`: two slices,
the plain loop stepping the one its step's timestep picks (WanPipeline's boundary 0.875; one AdamW over both, as a
user would hold them), diffpipe's `model.expert = "both"` (models/two_experts.py); both draw the timesteps the same way.

--checkpointing recomputes every block's activations in backward: diffusers' `enable_gradient_checkpointing()` in
the plain loop, `pipeline.checkpointing = "all"` in diffpipe (the whole 1.3B model at 81 frames needs it on 141 GB).

    python bench/wan_slice.py --lora 16 --base-dtype bf16 [--compile] [--fp8-compute on|both] [--attention cudnn]
                              [--fp8-attention on|both]

--lora RANK trains LoRAs on the attention's projections (the family's targets; peft's in the plain loop, as a user
injects them) over a frozen base stored in --base-dtype; --compile compiles the repeated blocks in both loops
(`compile_repeated_blocks` / `pipeline.compile = "blocks"`); --fp8-compute runs diffpipe's LoRA over an fp8 base whose
products are fp8 (`train.fp8_compute`; "both": also the --base-dtype run); --attention picks SDPA's kernel in both
loops (flash: cuDNN's off, as before; cudnn: left on, torch's own order, which takes it first on an H100);
--fp8-attention runs diffpipe's self-attention on cuDNN's fp8 kernels (`train.fp8_attention`; "both": also without).

Prints one JSON line per measurement: median step after the first two, video frames/s (latent frames x 4 - 3 per
clip), TFLOP/s (the FLOPs of one forward counted by torch's FlopCounterMode on the meta device, times 3, over the
median step) and the peak allocated memory.
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
from diffpipe.models.families.wan.wan import WAN_PRESETS  # noqa: E402
from diffpipe.models.families.wan.clip import WAN_CLIP_TOKENS  # noqa: E402
from diffpipe.models.families.wan.i2v import WAN_I2V_PRESETS  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402

TOKENS = 512  # text tokens


def _slice(args) -> dict:
    return dict({**WAN_PRESETS, **WAN_I2V_PRESETS}[args.preset], num_layers=args.blocks)


def _latent_size(args) -> tuple[int, int]:
    """Latent rows and columns: an 832x480 clip through Wan 2.1's 8x VAE, or a 1280x704 one through TI2V's 16x."""
    return (44, 80) if args.preset == "ti2v-5b" else (60, 104)


def _architecture(args) -> str:
    return "wan_i2v" if args.preset in WAN_I2V_PRESETS else "wan"


def _replaces_first_frame(args) -> bool:
    return args.preset in WAN_I2V_PRESETS and _slice(args)["in_channels"] == _slice(args)["out_channels"]


def _inputs(args, device: str = "cuda") -> dict:
    """The transformer's input: noisy latents (image-to-video: with the first frame's mask and latents joined, as
    WanImageToVideoPipeline joins them, or TI2V's first frame in place with a timestep per token), timesteps, text."""
    on = dict(device=device)
    channels, (height, width) = _slice(args)["in_channels"], _latent_size(args)
    timestep = torch.rand(args.batch, **on) * 1000
    if _replaces_first_frame(args):
        per_frame = timestep.view(-1, 1).repeat(1, args.frames)
        per_frame[:, 0] = 0
        timestep = per_frame.repeat_interleave(height * width // 4, dim=1)  # (B, tokens), 2x2 patches
    picture = {}
    if _slice(args).get("image_dim"):  # Wan 2.1 I2V: the picture's CLIP states
        picture["encoder_hidden_states_image"] = torch.randn(args.batch, WAN_CLIP_TOKENS, _slice(args)["image_dim"], **on)
    return dict(hidden_states=torch.randn(args.batch, channels, args.frames, height, width, **on),
                timestep=timestep, encoder_hidden_states=torch.randn(args.batch, TOKENS, 4096, **on), **picture)


def step_flops(args) -> float:
    """One training step's FLOPs: the forward's, counted on the meta device (no memory, no time), times 3."""
    from diffusers import WanTransformer3DModel
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = WanTransformer3DModel(**_slice(args))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(**_inputs(args, "meta"), return_dict=False)
    return 3.0 * counter.get_total_flops()


def _report(what: str, args, steps: list[float], flops: float, **extra) -> None:
    median = statistics.median(steps[2:])
    video_frames = args.batch * (4 * args.frames - 3)
    print(json.dumps({"what": what, "preset": args.preset, "blocks": args.blocks, "checkpointing": args.checkpointing,
                      "experts": 2 if args.both else 1,
                      "latent_frames": args.frames,
                      "video_frames": 4 * args.frames - 3, "batch": args.batch, "median_step_s": round(median, 4),
                      "video_frames_per_s": round(video_frames / median, 2),
                      "tflops": round(flops / median / 1e12, 1),
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), **extra}), flush=True)


def _plain_expert(args):
    """One WanTransformer3DModel on the GPU as a user sets it up: with --lora, a frozen base in --base-dtype and
    peft's adapters (kept in fp32) on the family's targets; --compile: its repeated blocks compiled."""
    from diffusers import WanTransformer3DModel

    with torch.device("cuda"):
        model = WanTransformer3DModel(**_slice(args))
    if args.lora:
        from peft import LoraConfig, inject_adapter_in_model

        from diffpipe.models.registry import family_for

        model.to(dtype=torch.bfloat16 if args.base_dtype == "bf16" else torch.float32).requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=args.lora, lora_alpha=args.lora,
                                           target_modules=list(family_for(_architecture(args)).lora_targets)), model)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    if args.checkpointing:
        model.enable_gradient_checkpointing()
    if args.compile:
        model.compile_repeated_blocks(fullgraph=True)
    return model.train()


def plain_loop(args, flops: float) -> None:
    """diffusers' model, its own forward, AdamW: the loop a user writes."""
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    experts = [_plain_expert(args) for _ in range(2 if args.both else 1)]
    opt = torch.optim.AdamW([p for model in experts for p in model.parameters() if p.requires_grad], lr=1e-5,
                            fused=True)
    inputs = _inputs(args)
    target = torch.randn_like(inputs["hidden_states"][:, :_slice(args)["out_channels"]])

    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model = experts[0] if float(inputs["timestep"].flatten()[0]) >= 875 else experts[-1]  # WanPipeline's pick
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**inputs, return_dict=False)[0]
        torch.nn.functional.mse_loss(out.float(), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for model in experts for p in model.parameters())
    _report(f"plain WanTransformer3DModel loop{_how(args)}", args, times, flops, params_B=round(params / 1e9, 2),
            step_ms=[round(t * 1e3, 1) for t in times])


def _how(args, fp8_compute: bool = False, fp8_attention: bool = False) -> str:
    lora = f", LoRA r{args.lora} over a {'fp8' if fp8_compute else args.base_dtype} base" if args.lora else ""
    attention = "fp8 attention (cuDNN's fp8 kernels)" if fp8_attention else f"{args.attention} attention"
    return f"{lora}{', compiled blocks' if args.compile else ''}{', fp8 compute' if fp8_compute else ''}, {attention}"


def diffpipe_run(args, flops: float, fp8_compute: bool = False, fp8_attention: bool = False) -> None:
    torch.cuda.reset_peak_memory_stats()
    table = {
        "model": {"architecture": _architecture(args), "config": _slice(args), "text_max_length": TOKENS,
                  "expert": "both" if args.both else None},
        "data": {"dataset": "synthetic", "frames": args.frames, "latent_size": list(_latent_size(args))},
        "train": {"max_steps": args.steps, "batch_size": args.batch, "learning_rate": 1e-5, "precision": "bf16",
                  "objective": "flow_matching", "device": "cuda", "fp8_compute": fp8_compute,
                  "fp8_attention": fp8_attention},
        "pipeline": {"stages": 1, "microbatches": 1, "checkpointing": "all" if args.checkpointing else "none",
                     "compile": "blocks" if args.compile else False},
        "observe": {"every": 1000, "timeline_step": 0, "log_every": 0},
        "output": {"save_weights": False, "sample_every_end": False}, "checkpoint": {"every": 0}}
    if args.lora:
        table["adapter"] = {"type": "lora", "rank": args.lora, "alpha": float(args.lora)}
        table["memory"] = {"base_dtype": "fp8" if fp8_compute else args.base_dtype}
    run_dir = Path(tempfile.mkdtemp())
    Trainer(build_config(table), single_process_topology("cuda"), run_dir).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows]
    _report(f"diffpipe, one stage{_how(args, fp8_compute, fp8_attention)}", args, times, flops,
            step_ms=[round(t * 1e3, 1) for t in times])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=[*WAN_PRESETS, *WAN_I2V_PRESETS], default="t2v-14b")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--frames", type=int, default=21, help="latent frames (21: 81 video frames; 9: 33)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--only", choices=["plain", "diffpipe"], default=None)
    parser.add_argument("--both", action="store_true", help="two experts (Wan 2.2 A14B's), switched by timestep")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK")
    parser.add_argument("--base-dtype", choices=["fp32", "bf16"], default="fp32", help="the LoRA's frozen base")
    parser.add_argument("--compile", action="store_true", help="compile the repeated blocks in both loops")
    parser.add_argument("--fp8-compute", choices=["off", "on", "both"], default="off",
                        help="diffpipe's LoRA over an fp8 base computing in fp8 (both: also the --base-dtype run)")
    parser.add_argument("--attention", choices=["flash", "cudnn"], default="flash",
                        help="SDPA's kernel in both loops: flash (cuDNN's off) or cuDNN's first")
    parser.add_argument("--fp8-attention", choices=["off", "on", "both"], default="off",
                        help="diffpipe's self-attention in fp8, train.fp8_attention (both: also without)")
    args = parser.parse_args()
    if args.fp8_compute != "off" and not args.lora:
        parser.error("--fp8-compute needs --lora (fp8 compute runs a LoRA's frozen base)")
    if args.attention == "flash":  # torch's own order then (cuDNN's first on an H100 under torch 2.11)
        torch.backends.cuda.enable_cudnn_sdp(False)
    flops = step_flops(args)
    if args.only != "diffpipe":
        plain_loop(args, flops)
    choices = {"off": [False], "on": [True], "both": [False, True]}
    for fp8_compute in choices[args.fp8_compute]:
        for fp8_attention in choices[args.fp8_attention]:
            gc.collect()
            torch.cuda.empty_cache()
            if args.only != "plain":
                diffpipe_run(args, flops, fp8_compute, fp8_attention)


if __name__ == "__main__":
    main()
