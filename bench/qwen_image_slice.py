"""A Qwen-Image-width slice on one GPU: diffpipe (one stage) against a plain `QwenImageTransformer2DModel` training
loop on the same slice; samples/s, model TFLOP/s and peak memory. Qwen-Image's width (3072, 24 heads of 128, text
3584 wide) with fewer of its 60 blocks, random weights, 1024x1024 pictures (128x128 latents packed 2x2: 4,096 image
tokens), captions of 128 tokens (every position filled: the plain loop passes no mask, as QwenImagePipeline then
does, and diffpipe's text is cut to 128 unmasked), fp32 weights, bf16 autocast, fused AdamW, the whole batch as one
micro-batch.

    python bench/qwen_image_slice.py [--blocks 6] [--batch 1] [--steps 6] [--checkpointing] [--only plain|diffpipe]
    python bench/qwen_image_slice.py --blocks 60 --lora 16 --base-dtype bf16 --steps 12   # the whole 20 B model
    python bench/qwen_image_slice.py --edit ...   # Qwen-Image-Edit: a 1024x1024 control's 4096 tokens beside the
                                                  # picture's, text of 1536 (the control's 1369 vision tokens + caption)
    python bench/qwen_image_slice.py --edit --zero-cond-t ...   # Qwen-Image-Edit-2511's transformer, 512 text positions

Both loops clip gradients to --clip's global norm (1.0: diffpipe's default and diffusers' training scripts'; 0 turns
it off in both). With --profile DIR each loop's CUDA kernels over its steps are written to DIR as a table (the
diffpipe run's include building its random weights: read the training kernels).

With --lora RANK both loops train a LoRA of that rank on to_q/to_k/to_v/to_out.0 over a base stored in --base-dtype
(the plain loop: peft's `inject_adapter_in_model`, the adapters in fp32), as users train the 20 B model on one GPU.

Prints one JSON line per measurement: median step after the first two, samples/s, TFLOP/s (the FLOPs of one forward
counted by torch's FlopCounterMode on the meta device, times 3, over the median step) and the peak allocated memory.
"""
from __future__ import annotations

import argparse
import contextlib
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
from diffpipe.models.families.qwen_image.qwen_image import QWEN_IMAGE_PRESETS  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402

TOKENS, SIDE = 128, 128  # text tokens; latent side of a 1024x1024 picture
EDIT_TOKENS = 1536  # an edit's text: a 1024x1024 control's 1369 vision tokens and the caption, cut to EDIT_TEXT_LENGTHS


PLUS_TOKENS = 512  # 2509/2511 (the Plus pipeline): a 384x384-sized control's 196 vision tokens and the caption


def _text_tokens(args) -> int:
    if args.edit:
        return PLUS_TOKENS if args.zero_cond_t else EDIT_TOKENS
    return TOKENS


def _slice(args) -> dict:
    return dict(QWEN_IMAGE_PRESETS["20b"], num_layers=args.blocks, **({"zero_cond_t": True} if args.zero_cond_t else {}))


def _inputs(args, device: str = "cuda") -> dict:
    """The model's inputs; with --edit a control's tokens after the picture's, as QwenImageEditPipeline joins them."""
    on, copies = dict(device=device), 2 if args.edit else 1
    return dict(hidden_states=torch.randn(args.batch, copies * (SIDE // 2) ** 2, 64, **on),
                timestep=torch.rand(args.batch, **on),
                encoder_hidden_states=torch.randn(args.batch, _text_tokens(args), 3584, **on),
                img_shapes=[[(1, SIDE // 2, SIDE // 2)] * copies] * args.batch)


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


@contextlib.contextmanager
def _profiled(args, name: str):
    """The CUDA kernels of what runs inside, as a table in args.profile (nothing without it)."""
    if not args.profile:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield
    Path(args.profile).mkdir(parents=True, exist_ok=True)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
    (Path(args.profile) / f"{name}.txt").write_text(table)


def _report(what: str, args, steps: list[float], flops: float, **extra) -> None:
    median = statistics.median(steps[2:])
    print(json.dumps({"what": what, "blocks": args.blocks, "checkpointing": args.checkpointing, "batch": args.batch,
                      "lora": args.lora, "base_dtype": args.base_dtype, "clip": args.clip,
                      "edit": args.edit, "zero_cond_t": args.zero_cond_t, "text_tokens": _text_tokens(args), "median_step_s": round(median, 4),
                      "samples_per_s": round(args.batch / median, 3), "tflops": round(flops / median / 1e12, 1),
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), **extra}), flush=True)


LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def plain_loop(args, flops: float) -> None:
    """diffusers' model, its own forward, AdamW: the loop a user writes (peft's LoRA with --lora)."""
    from diffusers import QwenImageTransformer2DModel

    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.lora and args.base_dtype == "bf16" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # 20 B random weights drawn on the GPU in the base's dtype, not copied there
    try:
        with torch.device("cuda"):
            model = QwenImageTransformer2DModel(**_slice(args)).train()
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
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    inputs = _inputs(args)
    target = torch.randn(args.batch, (SIDE // 2) ** 2, 64, device="cuda")
    trained = [p for p in model.parameters() if p.requires_grad]
    times = []
    with _profiled(args, "plain"):
        for _ in range(args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(**inputs, return_dict=False)[0][:, :target.shape[1]]  # (an edit's: the picture's)
            torch.nn.functional.mse_loss(out.float(), target).backward()
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(trained, args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    _report(f"plain QwenImageTransformer2DModel loop{' (edit)' if args.edit else ''}", args, times, flops, params_B=round(params / 1e9, 2))


def diffpipe_run(args, flops: float) -> None:
    torch.cuda.reset_peak_memory_stats()
    table = {
        "model": {"architecture": "qwen_image_edit" if args.edit else "qwen_image", "config": _slice(args),
                  "text_max_length": _text_tokens(args)},
        "data": {"dataset": "synthetic", "latent_size": [SIDE, SIDE]},
        "train": {"max_steps": args.steps, "batch_size": args.batch, "learning_rate": 1e-5, "precision": "bf16",
                  "objective": "flow_matching", "device": "cuda", "max_grad_norm": args.clip},
        "pipeline": {"stages": 1, "microbatches": 1, "checkpointing": "all" if args.checkpointing else "none"},
        "observe": {"every": 1000, "timeline_step": 0, "log_every": 0},
        "output": {"save_weights": False, "sample_every_end": False}, "checkpoint": {"every": 0},
        "memory": {"base_dtype": args.base_dtype}}
    if args.lora:
        table["adapter"] = {"type": "lora", "rank": args.lora, "alpha": float(args.lora), "target_modules": LORA_TARGETS}
    config = build_config(table)
    run_dir = Path(tempfile.mkdtemp())
    with _profiled(args, "diffpipe"):
        Trainer(config, single_process_topology("cuda"), run_dir).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    _report(f"diffpipe{' qwen_image_edit' if args.edit else ''}, one stage", args, [r["step_time_s"] for r in rows], flops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--only", choices=["plain", "diffpipe"], default=None)
    parser.add_argument("--lora", type=int, default=None, metavar="RANK")
    parser.add_argument("--base-dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient norm both loops clip to; 0: off")
    parser.add_argument("--profile", default=None, metavar="DIR")
    parser.add_argument("--edit", action="store_true", help="Qwen-Image-Edit: a control's tokens beside each picture's")
    parser.add_argument("--zero-cond-t", action="store_true",
                        help="with --edit, Qwen-Image-Edit-2511's transformer: the control's tokens at time zero")
    args = parser.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)  # as bench/flux_slice.py: cuDNN's attention backward failed on H200
    flops = step_flops(args)
    if args.only != "diffpipe":
        plain_loop(args, flops)
    gc.collect()
    torch.cuda.empty_cache()
    if args.only != "plain":
        diffpipe_run(args, flops)
    if args.lora:  # the forward's FLOPs stand; a LoRA step's backward skips the frozen weights' gradients
        print(json.dumps({"note": "tflops counts 3x the forward, as for full training; LoRA's backward does less"}))


if __name__ == "__main__":
    main()
