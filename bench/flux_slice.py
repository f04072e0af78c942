"""A Flux-width slice on one GPU: diffpipe (one stage) against a plain `FluxTransformer2DModel` training loop on the
same slice; samples/s, model TFLOP/s and peak memory. Flux.1-dev's width (3072, 24 heads of 128, T5 width 4096,
guidance embedding) with fewer blocks, random weights, 1024x1024 (4096 image tokens, 512 text tokens), fp32
weights, bf16 autocast, fused AdamW, the whole batch as one micro-batch. Also times the rotary embedding, which
the Flux adapter computes once and sends across stage boundaries, against the bytes it adds to a boundary.

    python bench/flux_slice.py [--double 4] [--single 8] [--batch 2] [--steps 8]
    python bench/flux_slice.py --double 19 --single 38 --batch 1 --steps 20 --lora 16 --base-dtype bf16 --gc both
    python bench/flux_slice.py --kontext ...   # Flux Kontext: a 1024x1024 control's 4096 tokens beside the picture's
    python bench/flux_slice.py --chroma ...    # Chroma1-HD's blocks (no guidance or pooled text; modulation pruned)
    python bench/flux_slice.py --flux2 klein-4b --double 5 --single 20 --batch 1 --lora 16 --base-dtype bf16
                                               # FLUX.2 klein (issue 57): 32-channel latents in 2x2 patches (128
                                               # wide), Qwen3's 3 x 2560-wide text, no guidance embedding
    python bench/flux_slice.py --double 19 --single 38 --batch 1 --steps 20 --lora 16 --base-dtype bf16 --compile \
        --fp8-compute both                  # issue 54: compiled blocks, diffpipe with and without fp8 compute

--compile compiles the repeated blocks in both loops (`pipeline.compile = "blocks"`; diffusers'
`compile_repeated_blocks(fullgraph=True)` in the plain one). --fp8-compute on|both runs diffpipe with
`train.fp8_compute` (the base's linear weights in fp8, their products on fp8 tensor cores; with both, also without).

With --lora RANK both loops train a LoRA of that rank on to_q/to_k/to_v/to_out.0 (issue 33's anchor; FLUX.2: also
its single blocks' fused `to_qkv_mlp_proj`, the family's targets) over a base stored in --base-dtype. Each diffpipe run also lists the host's garbage collections of the oldest generation (a
pause of the whole host, every Python object scanned) and the steps they fell in; --gc both runs diffpipe twice,
as it runs and with `gc.freeze()` before training (what it held after building never scanned again).

Prints one JSON line per measurement: median step after the first two, samples/s, TFLOP/s (the FLOPs of one
forward counted by torch's FlopCounterMode on the meta device, times 3 for forward and backward, over the median
step) and the peak allocated memory.
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
from diffpipe.models.families.flux.chroma import CHROMA_PRESETS  # noqa: E402
from diffpipe.models.families.flux.flux import FLUX_PRESETS, image_ids  # noqa: E402
from diffpipe.models.families.flux.kontext import reference_ids  # noqa: E402
from diffpipe.models.families.flux2.flux2 import FLUX2_PRESETS, Flux2Family, text_ids  # noqa: E402
from diffpipe.models.families.flux2.flux2 import image_ids as flux2_image_ids  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402

TOKENS, LATENT = 512, 128


def architecture(args) -> str:
    return "flux2" if args.flux2 else "chroma" if args.chroma else "flux_kontext" if args.kontext else "flux"


def _slice(args) -> dict:
    preset = (FLUX2_PRESETS[args.flux2] if args.flux2 else CHROMA_PRESETS["hd"] if args.chroma
              else FLUX_PRESETS["dev"])
    return dict(preset, num_layers=args.double, num_single_layers=args.single)


def _model_class(args):
    import diffusers

    return (diffusers.Flux2Transformer2DModel if args.flux2 else diffusers.ChromaTransformer2DModel if args.chroma
            else diffusers.FluxTransformer2DModel)


def lora_targets(architecture: str) -> list[str]:
    return list(Flux2Family.lora_targets) if architecture == "flux2" else ["to_q", "to_k", "to_v", "to_out.0"]


def _flux2_inputs(batch: int, device: str, size: dict) -> dict:
    """FLUX.2's inputs as Flux2KleinPipeline gives its transformer: 4096 tokens of 2x2 patches, 512 caption
    positions, position ids of four axes, no guidance on klein."""
    cuda = dict(device=device)
    inputs = dict(hidden_states=torch.randn(batch, (LATENT // 2) ** 2, size["in_channels"], **cuda),
                  timestep=torch.rand(batch, **cuda),
                  encoder_hidden_states=torch.randn(batch, TOKENS, size["joint_attention_dim"], **cuda),
                  img_ids=flux2_image_ids((LATENT // 2, LATENT // 2), device), txt_ids=text_ids(TOKENS, device))
    if size["guidance_embeds"]:
        inputs["guidance"] = torch.full((batch,), 4.0, **cuda)
    return inputs


def _inputs(batch: int, device: str = "cuda", kontext: bool = False, chroma: bool = False,
            flux2: dict | None = None) -> dict:
    """The model's inputs; with `kontext`, a control's tokens after the picture's, as FluxKontextPipeline joins them;
    with `chroma`, no guidance or pooled text (every text position filled, as the synthetic captions: no mask);
    with `flux2` (the model's config), FLUX.2's."""
    if flux2 is not None:
        return _flux2_inputs(batch, device, flux2)
    cuda = dict(device=device)
    picture, ids = (LATENT // 2) ** 2, image_ids((LATENT, LATENT), device)
    if kontext:
        ids = torch.cat((ids, reference_ids((LATENT, LATENT), device)))
    inputs = dict(hidden_states=torch.randn(batch, picture * (2 if kontext else 1), 64, **cuda),
                  timestep=torch.rand(batch, **cuda), encoder_hidden_states=torch.randn(batch, TOKENS, 4096, **cuda),
                  img_ids=ids, txt_ids=torch.zeros(TOKENS, 3, **cuda))
    if not chroma:
        inputs.update(guidance=torch.full((batch,), 3.5, **cuda), pooled_projections=torch.randn(batch, 768, **cuda))
    return inputs


def step_flops(args) -> float:
    """One training step's FLOPs: the forward's, counted on the meta device (no memory, no time), times 3."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = _model_class(args)(**_slice(args))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(**_inputs(args.batch, "meta", args.kontext, args.chroma, _slice(args) if args.flux2 else None),
              return_dict=False)
    return 3.0 * counter.get_total_flops()


def _report(what: str, batch: int, steps: list[float], flops: float, **extra) -> None:
    median = statistics.median(steps[2:])
    print(json.dumps({"what": what, "batch": batch, "median_step_s": round(median, 4),
                      "samples_per_s": round(batch / median, 3), "tflops": round(flops / median / 1e12, 1),
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), **extra}), flush=True)


def _config(args, fp8_compute: bool = False):
    table = {
        "model": {"architecture": architecture(args), "config": _slice(args),
                  "text_max_length": TOKENS},
        "data": {"dataset": "synthetic"},
        "train": {"max_steps": args.steps, "batch_size": args.batch, "learning_rate": 1e-5, "precision": "bf16",
                  "objective": "flow_matching", "device": "cuda", "fp8_compute": fp8_compute},
        "pipeline": {"stages": 1, "microbatches": 1, "checkpointing": "none",
                     "compile": "blocks" if args.compile else False},
        "memory": {"base_dtype": "fp8" if fp8_compute else args.base_dtype},
        "observe": {"every": 1000, "timeline_step": 0, "log_every": 0},
        "output": {"save_weights": False, "sample_every_end": False}, "checkpoint": {"every": 0}}
    if args.lora:
        table["adapter"] = {"type": "lora", "rank": args.lora, "alpha": float(args.lora),
                            "target_modules": lora_targets(architecture(args))}
    return build_config(table)


def plain_loop(args, flops: float) -> None:
    """diffusers' model, its own forward, AdamW: the loop a user writes (peft's LoRA with --lora)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from profile_step import _plain_model

    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model, inputs = _plain_model(_config(args), args.batch, args.lora, bf16_base=args.base_dtype == "bf16")
    if args.compile:
        model.compile_repeated_blocks(fullgraph=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    target = torch.randn(args.batch, (LATENT // 2) ** 2, _slice(args)["in_channels"] if args.flux2 else 64,
                         device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**inputs, return_dict=False)[0][:, :target.shape[1]]  # Kontext: the picture's tokens
        torch.nn.functional.mse_loss(out.float(), target).backward()

    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    _report(f"plain {_model_class(args).__name__} loop{' (Kontext)' if args.kontext else ''}"
            f"{', compiled blocks' if args.compile else ''}", args.batch, times, flops,
            params_B=round(params / 1e9, 2), step_ms=[round(t * 1e3, 1) for t in times])
    del model, opt


class OldestCollections:
    """The garbage collections of the oldest generation while in use: (when, milliseconds)."""

    def __init__(self):
        self.seen: list[tuple[float, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seen.append((self._start, (time.perf_counter() - self._start) * 1e3))

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def diffpipe_run(args, flops: float, freeze: bool, fp8_compute: bool = False) -> None:
    torch.cuda.reset_peak_memory_stats()
    run_dir = Path(tempfile.mkdtemp())
    trainer = Trainer(_config(args, fp8_compute), single_process_topology("cuda"), run_dir)
    if freeze:
        gc.collect()
        gc.freeze()
    with OldestCollections() as collections:
        started = time.perf_counter()
        trainer.fit()
    gc.unfreeze()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows]
    what = (f"diffpipe {architecture(args)}, one stage{', gc frozen' if freeze else ''}"
            f"{', compiled blocks' if args.compile else ''}{', fp8 compute' if fp8_compute else ''}")
    _report(what, args.batch, times, flops,
            step_ms=[round(t * 1e3, 1) for t in times], tracked_objects=len(gc.get_objects()),
            oldest_collections=[[round(at - started, 2), round(ms, 1)] for at, ms in collections.seen])
    del trainer


def rotary_cost() -> None:
    """The rotary embedding of 4608 positions: time to compute it, bytes it adds to each stage boundary."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    pos = FluxPosEmbed(theta=10000, axes_dim=list(FLUX_PRESETS["dev"]["axes_dims_rope"]))
    ids = torch.cat((torch.zeros(TOKENS, 3, device="cuda"), image_ids((LATENT, LATENT), "cuda")))
    for _ in range(5):
        cos, sin = pos(ids)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(100):
        cos, sin = pos(ids)
    torch.cuda.synchronize()
    per_call = (time.perf_counter() - start) / 100
    print(json.dumps({"what": "rotary embedding, 4608 positions", "compute_ms": round(per_call * 1e3, 3),
                      "boundary_bytes_MB": round(2 * cos.numel() * cos.element_size() / 1e6, 2),
                      "blocks_in_flux_dev": 57}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--double", type=int, default=4)
    parser.add_argument("--single", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", choices=["plain", "diffpipe"], default=None)
    parser.add_argument("--lora", type=int, default=None, metavar="RANK")
    parser.add_argument("--base-dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--kontext", action="store_true", help="Flux Kontext: a control image's tokens beside each picture's")
    parser.add_argument("--chroma", action="store_true", help="Chroma: its blocks at Chroma1-HD's width")
    parser.add_argument("--flux2", choices=sorted(FLUX2_PRESETS), default=None,
                        help="FLUX.2's blocks at this preset's width (klein-4b, klein-9b, dev)")
    parser.add_argument("--compile", action="store_true", help="compile the repeated blocks in both loops")
    parser.add_argument("--fp8-compute", choices=["off", "on", "both"], default="off",
                        help="diffpipe with train.fp8_compute (both: with and without)")
    parser.add_argument("--attention", choices=["flash", "cudnn"], default="flash",
                        help="SDPA's kernels in both loops: flash (cuDNN's off, as diffpipe runs Flux) or cuDNN's")
    parser.add_argument("--memory-fraction", type=float, default=None,
                        help="cap torch's allocator at this share of the card (what it leaves, the driver has)")
    parser.add_argument("--gc", choices=["default", "frozen", "both"], default="default",
                        help="diffpipe as it runs, with gc.freeze() before training, or both")
    args = parser.parse_args()
    # torch 2.11 on an H200: cuDNN's attention backward fails on Flux's shapes ("mha_graph.execute(...).is_good()",
    # seen as CUBLAS_STATUS_EXECUTION_FAILED without CUDA_LAUNCH_BLOCKING) in the plain loop and in diffpipe alike;
    # flash attention is used instead, for both. --attention cudnn tries cuDNN's again (issue 54: alone, at Flux's
    # shapes, it ran on an H100 at 1.9x flash's speed, bench/attention_backends.py): the Flux families' own refusal
    # (their `cudnn_attention` flag, which diffpipe's build reads) is lifted in this process for the experiment
    if args.memory_fraction:
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    if args.attention == "flash":
        torch.backends.cuda.enable_cudnn_sdp(False)
    else:
        from diffpipe.models.registry import family_for

        type(family_for(architecture(args))).cudnn_attention = True
    rotary_cost()
    flops = step_flops(args)
    if args.only != "diffpipe":
        plain_loop(args, flops)
    gc.collect()
    torch.cuda.empty_cache()
    if args.only != "plain":
        for fp8_compute in {"off": [False], "on": [True], "both": [False, True]}[args.fp8_compute]:
            for freeze in {"default": [False], "frozen": [True], "both": [False, True]}[args.gc]:
                diffpipe_run(args, flops, freeze, fp8_compute)
                gc.collect()
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
