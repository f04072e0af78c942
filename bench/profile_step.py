"""Where the device time of a training step goes: diffpipe's training loop (one process, one stage, as
`diffpipe train` runs it: batches made in the background, steps read once the next is queued) against the
plain loop, under torch.profiler (device activity only). Prints one JSON line per loop: per steady step, the
span on the GPU, the time its kernels keep it busy, the idle gaps (with the kernels on either side), the kernels
that take the most time; then the kernels whose time differs most between the two.

    python bench/profile_step.py examples/sdxl_unet.toml [--steps 4] [--top 20] [--compile] [--lora RANK] [--set KEY=VALUE ...]
    python bench/profile_step.py examples/flux_dev.toml --batch 1 --lora 16 --set 'memory.base_dtype="bf16"'
    python bench/profile_step.py examples/qwen_image_lora.toml --batch 1 --lora 16 --set 'memory.block_swap=0'

With --lora RANK both loops train a LoRA of that rank (alpha = rank) on the family's LoRA targets (Flux: to_q, to_k,
to_v, to_out.0, issue 33's anchor): the plain loop injects it with peft as a user would, diffpipe through its adapter
settings. The config's model.architecture picks the plain loop (a diffusers UNet2DConditionModel at the SDXL preset,
a FluxTransformer2DModel or a QwenImageTransformer2DModel at the config's size, 1024x1024); with a LoRA and `memory.base_dtype="bf16"` the plain
loop's base is cast to bf16 too.

Steps are told apart on the GPU by the fused AdamW kernels that end each one; the first 3 steps (warm-up and,
with --compile, compiling) are left out.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from diffpipe.config_files import load_config  # noqa: E402
from diffpipe.distributed import resolve_device_kind, single_process_topology  # noqa: E402
from diffpipe.models.families.unet.presets import UNET_PRESETS  # noqa: E402
from diffpipe.models.families.unet.unet2d import UNet2DFamily  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402
from sdxl_one_gpu import _inputs  # noqa: E402

FLUX_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]

WARMUP = 3


def _short(name: str) -> str:
    """The kernel's name cut to 90 characters; the fused optimizer's marked, its functor being past the cut."""
    return ("[AdamW] " if "Adam" in name else "") + name[:90]


def _kernels(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device kernel and copy, in start order."""
    out = [(e.time_range.start, e.time_range.end, _short(e.name)) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(out)


def _step_ends(kernels, quiet: int = 50) -> list[float]:
    """End of each step's optimizer: an AdamW kernel followed by at least `quiet` other kernels (the next
    forward) before the next AdamW kernel; the optimizer itself launches a few others between its own."""
    ends, last_adam, since = [], None, 0
    for _, end, name in kernels:
        if "[AdamW]" in name:
            if last_adam is not None and since >= quiet:
                ends.append(last_adam)
            last_adam, since = end, 0
        else:
            since += 1
    if last_adam is not None:
        ends.append(last_adam)
    return ends


def _summarise(what: str, prof, top: int) -> dict[str, float]:
    kernels = _kernels(prof)
    ends = _step_ends(kernels)[WARMUP - 1:]  # steady steps run from the end of step WARMUP-1 ...
    if len(ends) < 2:
        print(json.dumps({"what": what, "error": f"found {len(ends)} step ends among {len(kernels)} kernels"}))
        return {}
    first, last = ends[0], ends[-1]
    steps = len(ends) - 1
    window = [k for k in kernels if first < k[0] and k[1] <= last]
    per_kernel: dict[str, float] = defaultdict(float)
    busy, gaps, reach, before = 0.0, [], first, "(previous step's optimizer)"
    for start, end, name in window:
        per_kernel[name] += (end - start) / 1e3
        if start > reach:
            gaps.append((start - reach, before, name))
        busy += max(0.0, end - max(start, reach))
        if end > reach:
            reach, before = end, name
    gaps.sort(reverse=True)
    span_ms = (last - first) / 1e3 / steps
    print(json.dumps({"what": what, "steps": steps, "gpu_span_ms_per_step": round(span_ms, 2),
                      "busy_ms_per_step": round(busy / 1e3 / steps, 2),
                      "idle_ms_per_step": round(span_ms - busy / 1e3 / steps, 2),
                      "largest_gaps_ms": [[round(g / 1e3, 3), a, b] for g, a, b in gaps[:top]],
                      "top": [[n, round(ms / steps, 2)] for n, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]]}),
          flush=True)
    return {name: ms / steps for name, ms in per_kernel.items()}


def _label(loop: str, compiled: bool, lora_rank: int | None) -> str:
    return loop + (" compiled" if compiled else "") + (f" lora r{lora_rank}" if lora_rank else "")


def _plain_model(config, batch: int, lora_rank: int | None, bf16_base: bool):
    """The family's diffusers model on the GPU, its inputs, and the trained parameters, as a user sets them up."""
    if config.model.architecture in ("flux", "flux_kontext", "chroma", "flux2"):
        from diffpipe.models.registry import family_for
        from flux_slice import _inputs as flux_inputs
        from flux_slice import lora_targets

        family = family_for(config.model.architecture)
        size = config.model.config or family.presets[config.model.preset]
        with torch.device("cuda"):  # 12 B random weights: drawn on the GPU, not the host
            model = family.model_class(**size)
        inputs = flux_inputs(batch, kontext=config.model.architecture == "flux_kontext",
                             chroma=config.model.architecture == "chroma",
                             flux2=size if config.model.architecture == "flux2" else None)
        targets = lora_targets(config.model.architecture)
    elif config.model.architecture == "qwen_image":
        from types import SimpleNamespace

        from diffusers import QwenImageTransformer2DModel
        from diffpipe.models.families.qwen_image.qwen_image import QWEN_IMAGE_PRESETS
        from qwen_image_slice import _inputs as qwen_inputs

        size = config.model.config or QWEN_IMAGE_PRESETS[config.model.preset]
        with torch.device("cuda"):  # 20 B random weights: drawn on the GPU, not the host
            model = QwenImageTransformer2DModel(**size)
        inputs, targets = qwen_inputs(SimpleNamespace(batch=batch)), FLUX_LORA_TARGETS
    else:
        from diffusers import UNet2DConditionModel

        model, inputs = UNet2DConditionModel(**UNET_PRESETS["sdxl"]), _inputs(batch, "cuda")
        targets = list(UNet2DFamily.lora_targets)
    model = model.to("cuda", torch.bfloat16 if bf16_base and lora_rank else torch.float32).train()
    if lora_rank is not None:
        from peft import LoraConfig, inject_adapter_in_model

        model.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=targets), model)
        for p in model.parameters():  # peft keeps adapters in the base's dtype here; trained weights stay fp32
            if p.requires_grad:
                p.data = p.data.float()
    return model, inputs


def plain(config, batch: int, steps: int, top: int, compiled: bool, lora_rank: int | None,
          bf16_base: bool) -> dict[str, float]:
    model, inp = _plain_model(config, batch, lora_rank, bf16_base)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    fwd = torch.compile(model) if compiled else model
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(WARMUP + steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = fwd(**inp, return_dict=False)[0]
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    kernels = _summarise(_label("plain", compiled, lora_rank), prof, top)
    del model, opt, fwd
    return kernels


def _config(config_path: str, sets: list[str], batch: int, steps: int, compiled: bool, lora_rank: int | None):
    if lora_rank is not None:
        sets = ['adapter.type="lora"', f"adapter.rank={lora_rank}", f"adapter.alpha={float(lora_rank)}", *sets]
        if load_config(config_path).model.architecture in ("flux", "qwen_image"):
            sets = ['adapter.target_modules=["to_q","to_k","to_v","to_out.0"]', *sets]
    return load_config(config_path, ["pipeline.stages=1", "pipeline.microbatches=1", f"train.batch_size={batch}",
                                       "pipeline.checkpointing=\"none\"", "plan.memory_gib=139",
                                       f"train.max_steps={WARMUP + steps}", f"pipeline.compile={str(compiled).lower()}",
                                       "output.save_weights=false", "output.sample_every_end=false",
                                       "train.device=\"cuda\"", *sets])


def diffpipe(config, compiled: bool, lora_rank: int | None, top: int) -> dict[str, float]:
    topo = single_process_topology(resolve_device_kind(config.train.device))
    trainer = Trainer(config, topo, Path(tempfile.mkdtemp()))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.fit()
        torch.cuda.synchronize()
    return _summarise(_label("diffpipe", compiled, lora_rank), prof, top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="diffpipe with pipeline.compile, the plain loop compiled")
    parser.add_argument("--batch", type=int, default=8, help="samples a step, one micro-batch (default 8)")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK", help="both loops train a LoRA of this rank")
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    # torch 2.11 on an H200: cuDNN's attention backward fails on Flux's shapes (bench/flux_slice.py); flash for both
    torch.backends.cuda.enable_cudnn_sdp(False)
    config = _config(args.config, args.set, args.batch, args.steps, args.compile, args.lora)
    mine = diffpipe(config, args.compile, args.lora, args.top)
    gc.collect()  # the trainer's modules, so the plain loop has the GPU's memory
    torch.cuda.empty_cache()
    theirs = plain(config, args.batch, args.steps, args.top, args.compile, args.lora,
                   bf16_base=config.memory.base_dtype in ("bf16", "auto"))
    diff = {k: mine.get(k, 0.0) - theirs.get(k, 0.0) for k in set(mine) | set(theirs)}
    ranked = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.top]
    print(json.dumps({"what": "diffpipe minus plain, ms per step", "kernels": [[k, round(v, 2)] for k, v in ranked]}),
          flush=True)


if __name__ == "__main__":
    main()
