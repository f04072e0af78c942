"""SDXL-width LoRA on one GPU: diffpipe (one stage) against a plain peft + diffusers LoRA loop, and against full
fine-tuning; samples/s and peak memory. SDXL UNet config, random weights, 1024x1024 (128x128 latents), fp32
weights, bf16 autocast, batch 8 in one micro-batch (SDXL_BATCH=N in the environment: N), fused AdamW.

    python bench/lora_sdxl.py [--ranks 16,64] [--steps 8] [--skip-full] [--base-dtypes bf16,fp32] [--loops] [--plain-draws] [--rounds N]
                              [--types lora,dora,loha,lokr] [--compile] [--fp8-compute]

--compile: diffpipe's runs with `pipeline.compile = "blocks"` (the UNet's transformer blocks compiled; the plain LoRA
loop stays eager, as the issue's goal compares), and the full fine-tune also as a plain loop under
`torch.compile(unet)` (the issue's baseline for it). --fp8-compute: each LoRA round also runs diffpipe over an fp8 base
whose products are fp8, and the full fine-tune also with its trained linear layers in fp8 (`train.fp8_compute`,
torchao's float8 training).

--types: adapter.type of both loops (the plain loop injects peft's adapters of that type the same way).

diffpipe's LoRA runs once per entry of --base-dtypes (memory.base_dtype: how the frozen UNet is stored; the
plain loop keeps it in fp32, as a user's loop does).

--loops also runs diffpipe's step by hand with the same trainer (its forward_backward, apply_gradients and
read_record), in two ways: the batch made in the training thread each step (no background thread competing for
the GIL), and one batch made once and reused (as the plain loop does): where the LoRA step's time goes.

--plain-draws also runs the plain loop on a batch drawn on the host each step (latents, noise, timesteps, text states
moved to the device in the loop's thread), as diffpipe's batches are drawn (in a background thread); --rounds N runs
the LoRA loops N times, alternating (the plain loop's own figure moves several % between runs of one call).

--host-profile runs the plain loop and diffpipe's step by hand (one batch made once, each step waited for) under
cProfile and prints each one's host seconds a step and the functions that take the most of it: where a host-bound step
(SDXL with LoRA launches many small kernels) spends what the other does not.

Prints one JSON line per configuration: the median step over the steps after the first two, samples/s and the
device's peak allocated memory over the run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffpipe.config_files import build_config, load_config  # noqa: E402
from diffpipe.distributed import single_process_topology  # noqa: E402
from diffpipe.models.lora import add_lora  # noqa: E402
from diffpipe.models.families.unet.presets import UNET_PRESETS  # noqa: E402
from diffpipe.models.families.unet.unet2d import UNet2DFamily  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402

BATCH = int(os.environ.get("SDXL_BATCH", 8))  # SDXL_BATCH=3: the full fine-tune uncheckpointed on an 80 GB card


def _report(what: str, rank: int | None, steps: list[float]) -> None:
    median = statistics.median(steps[2:])
    print(json.dumps({"what": what, "rank": rank, "median_step_s": round(median, 4),
                      "samples_per_s": round(BATCH / median, 2),
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}), flush=True)


def _host_profile(what: str, run_steps, steps: int, top: int = 25) -> None:
    """`run_steps(steps)` under cProfile (after two unprofiled steps): host seconds a step and the top functions."""
    import cProfile
    import io
    import pstats

    run_steps(2)
    profiler = cProfile.Profile()
    profiler.runcall(run_steps, steps)
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    print(json.dumps({"what": f"host profile: {what}", "host_s_per_step": round(stats.total_tt / steps, 4),
                      "calls_per_step": stats.total_calls // steps}), flush=True)
    stats.sort_stats("tottime").print_stats(top)
    print(stream.getvalue(), flush=True)


def _drawn_batch(generator: torch.Generator) -> tuple[dict, torch.Tensor]:
    """A step's batch drawn on the host and moved to the device, as a loop that reads its data each step has it:
    latents, noise, timesteps, text states and SDXL's pooled embedding and size ids (what diffpipe's batch maker
    draws a step, less the reading of cached files)."""
    def draw(*shape):
        return torch.randn(*shape, generator=generator).to("cuda", non_blocking=True)

    latents, noise = draw(BATCH, 4, 128, 128), draw(BATCH, 4, 128, 128)
    t = torch.rand(BATCH, generator=generator).to("cuda", non_blocking=True)
    noisy = (1 - t.view(-1, 1, 1, 1)) * latents + t.view(-1, 1, 1, 1) * noise
    inputs = dict(sample=noisy, timestep=t * 1000, encoder_hidden_states=draw(BATCH, 77, 2048),
                  added_cond_kwargs=dict(text_embeds=draw(BATCH, 1280), time_ids=draw(BATCH, 6)))
    return inputs, noise - latents


def _timed_step(model, opt, inputs: dict, target: torch.Tensor, start: float) -> float:
    """One training step of a plain loop (bf16 autocast, MSE, the optimizer's step), waited for: seconds since
    `start`."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(**inputs).sample
    torch.nn.functional.mse_loss(out.float(), target).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def plain_peft_loop(rank: int, steps: int, host_profile: bool = False, kind: str = "lora",
                    draws: bool = False) -> None:
    """diffusers' UNet with peft's adapters (the same injection), AdamW on the adapters: the loop a user writes. It
    trains on one batch made once, or (`draws`) on a batch drawn on the host each step (`_drawn_batch`)."""
    from diffusers import UNet2DConditionModel

    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = UNet2DConditionModel(**UNET_PRESETS["sdxl"]).to("cuda").train()
    adapter = build_config({"adapter": {"type": kind, "rank": rank, "alpha": float(rank)}}).adapter
    add_lora(model, adapter, UNet2DFamily.lora_targets, seed=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    inputs = dict(sample=torch.randn(BATCH, 4, 128, 128, device="cuda"),
                  timestep=torch.randint(0, 1000, (BATCH,), device="cuda"),
                  encoder_hidden_states=torch.randn(BATCH, 77, 2048, device="cuda"),
                  added_cond_kwargs=dict(text_embeds=torch.randn(BATCH, 1280, device="cuda"),
                                         time_ids=torch.randn(BATCH, 6, device="cuda")))
    target = torch.randn(BATCH, 4, 128, 128, device="cuda")
    times = []
    generator = torch.Generator().manual_seed(0)

    def run_steps(count: int) -> None:
        nonlocal inputs, target
        for _ in range(count):
            torch.cuda.synchronize()
            start = time.perf_counter()
            if draws:
                inputs, target = _drawn_batch(generator)
            times.append(_timed_step(model, opt, inputs, target, start))
    if host_profile:
        _host_profile("plain peft loop", run_steps, steps)
        return
    run_steps(steps)
    _report(f"plain peft loop, {kind}" + (", a batch drawn each step" if draws else ""), rank, times)
    del model, opt


def plain_full_loop(steps: int, compiled: bool) -> None:
    """The whole UNet trained in fp32 weights under bf16 autocast, fused AdamW, `torch.compile(unet)` if asked."""
    from diffusers import UNet2DConditionModel

    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = UNet2DConditionModel(**UNET_PRESETS["sdxl"]).to("cuda").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    run = torch.compile(model) if compiled else model
    inputs, target = _drawn_batch(torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        times.append(_timed_step(run, opt, inputs, target, time.perf_counter()))
    _report(f"plain full fine-tune{', torch.compile(unet)' if compiled else ''}", None, times)
    del model, opt, run


def diffpipe_run(rank: int | None, steps: int, base_dtype: str = "fp32", kind: str = "lora",
                 compiled: bool | str = False, fp8_compute: bool = False) -> None:
    """diffpipe, one stage, the same batch as one micro-batch (rank None: full fine-tune); `compiled`: True, its
    blocks compiled, "whole", the stage in one graph; `fp8_compute`: an fp8 base computing in fp8 (a full
    fine-tune: its wide enough linear layers training in fp8)."""
    torch.cuda.reset_peak_memory_stats()
    sets = ["pipeline.stages=1", "pipeline.microbatches=1", f"train.batch_size={BATCH}", f"train.max_steps={steps}",
            "observe.every=1000", "observe.timeline_step=0", "observe.log_every=0", "output.save_weights=false",
            "output.sample_every_end=false", "checkpoint.every=0", "train.learning_rate=1e-4",
            'pipeline.checkpointing="none"', 'train.device="cuda"', f"train.fp8_compute={str(fp8_compute).lower()}"]
    if compiled:  # "whole" as torch.compile(unet) compiles the model
        sets.append("pipeline.compile=true" if compiled == "whole" else 'pipeline.compile="blocks"')
    if rank is not None:
        base_dtype = "fp8" if fp8_compute else base_dtype
        sets += [f'adapter.type="{kind}"', f"adapter.rank={rank}", f"adapter.alpha={float(rank)}",
                 f'memory.base_dtype="{base_dtype}"']
    config = load_config(ROOT / "examples" / "sdxl_unet.toml", sets)
    run_dir = Path(tempfile.mkdtemp())
    trainer = Trainer(config, single_process_topology("cuda"), run_dir)
    trainer.fit()
    if rank is None and fp8_compute:  # a full fine-tune's: the layers wide enough for fp8 to pay (fp8_training.py)
        from torchao.float8.float8_linear import Float8Linear

        swapped = sum(isinstance(m, Float8Linear) for stage in trainer.modules for m in stage.modules())
        print(f"{swapped} linear layers trained in fp8", flush=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    what = f"diffpipe {kind}, {base_dtype} base" if rank is not None else "diffpipe full fine-tune"
    what += {True: ", compiled blocks", "whole": ", compiled whole", False: ""}[compiled]
    what += ", fp8 compute" if fp8_compute else ""
    _report(what, rank, [r["step_time_s"] for r in rows])
    del trainer


def diffpipe_by_hand(rank: int, steps: int, base_dtype: str, fixed_batch: bool, host_profile: bool = False) -> None:
    """diffpipe's LoRA step run by hand, each step waited for: the batch made in this thread each step, or once."""
    torch.cuda.reset_peak_memory_stats()
    sets = ["pipeline.stages=1", "pipeline.microbatches=1", f"train.batch_size={BATCH}", f"train.max_steps={steps}",
            "observe.enabled=false", "output.save_weights=false", "output.sample_every_end=false",
            "checkpoint.every=0", "train.learning_rate=1e-4", 'pipeline.checkpointing="none"', 'train.device="cuda"',
            'adapter.type="lora"', f"adapter.rank={rank}", f"adapter.alpha={float(rank)}",
            f'memory.base_dtype="{base_dtype}"']
    trainer = Trainer(load_config(ROOT / "examples" / "sdxl_unet.toml", sets), single_process_topology("cuda"),
                      Path(tempfile.mkdtemp()))
    from diffpipe.train.records import read_record

    batch = trainer.steps.batch_for(0) if fixed_batch else None
    times = []

    def run_steps(count: int) -> None:
        for _ in range(count):
            step = len(times)
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss, _ = trainer.steps.forward_backward(step, batch if fixed_batch else trainer.steps.batch_for(step))
            read_record(trainer.steps.apply_gradients(step, loss))
            times.append(time.perf_counter() - start)
    if host_profile:
        _host_profile(f"diffpipe lora by hand, {base_dtype} base", run_steps, steps)
        return
    run_steps(steps)
    how = "one batch made once" if fixed_batch else "batch made in the training thread"
    _report(f"diffpipe lora by hand, {base_dtype} base, {how}", rank, times)
    del trainer


def _free() -> None:
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip-full", action="store_true")
    parser.add_argument("--base-dtypes", default="bf16,fp32", help="memory.base_dtype of diffpipe's LoRA runs")
    parser.add_argument("--types", default="lora", help="adapter.type of both loops, comma-separated")
    parser.add_argument("--loops", action="store_true", help="also diffpipe's step by hand (see above)")
    parser.add_argument("--plain-draws", action="store_true", help="the plain loop also with a batch drawn on the "
                        "host each step (as diffpipe's is), beside the one made once")
    parser.add_argument("--rounds", type=int, default=1, help="the LoRA loops this many times, alternating")
    parser.add_argument("--host-profile", action="store_true", help="the plain loop and diffpipe's step by hand "
                        "under cProfile (see above), nothing else")
    parser.add_argument("--compile", action="store_true", help='diffpipe\'s runs with pipeline.compile = "blocks"')
    parser.add_argument("--fp8-compute", action="store_true", help="also diffpipe's LoRA over an fp8 base computing "
                        "in fp8")
    args = parser.parse_args()
    if args.host_profile:
        for rank in [int(r) for r in args.ranks.split(",") if r]:
            plain_peft_loop(rank, args.steps, host_profile=True)
            _free()
            for base_dtype in args.base_dtypes.split(","):
                diffpipe_by_hand(rank, args.steps, base_dtype, fixed_batch=True, host_profile=True)
                _free()
        return
    for rank in [int(r) for r in args.ranks.split(",") if r]:
        for kind in [k for _ in range(args.rounds) for k in args.types.split(",")]:
            plain_peft_loop(rank, args.steps, kind=kind)
            _free()
            if args.plain_draws:
                plain_peft_loop(rank, args.steps, kind=kind, draws=True)
                _free()
            for base_dtype in args.base_dtypes.split(","):
                diffpipe_run(rank, args.steps, base_dtype, kind, args.compile)
                _free()
            if args.fp8_compute:
                diffpipe_run(rank, args.steps, "fp8", kind, args.compile, fp8_compute=True)
                _free()
        for base_dtype in args.base_dtypes.split(",") if args.loops else ():
            for fixed in (False, True):
                diffpipe_by_hand(rank, args.steps, base_dtype, fixed)
                _free()
    if not args.skip_full:
        if args.compile:
            plain_full_loop(args.steps, compiled=True)
            _free()
        diffpipe_run(None, args.steps, compiled=args.compile)
        if args.fp8_compute:
            _free()
            diffpipe_run(None, args.steps, compiled=args.compile, fp8_compute=True)


if __name__ == "__main__":
    main()
