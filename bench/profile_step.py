"""Where the device time of a training step goes: diffpipe's step (one process, one stage) against the plain
loop, under torch.profiler. Prints one JSON line per loop: wall and summed kernel time per step, the
kernels that take the most device time per step, and the kernels whose time differs most between the two.

    python bench/profile_step.py examples/sdxl_unet.toml [--steps 2] [--top 20] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from diffpipe.config import load_config  # noqa: E402
from diffpipe.distributed import init_topology, resolve_device_kind  # noqa: E402
from diffpipe.models.presets import UNET_PRESETS  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402
from sdxl_one_gpu import _inputs  # noqa: E402


def _summarise(what: str, prof, steps: int, wall_s: float, top: int) -> dict[str, float]:
    per_kernel: dict[str, float] = defaultdict(float)
    total = 0.0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            ms = event.time_range.elapsed_us() / 1e3
            per_kernel[event.name[:90]] += ms
            total += ms
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    print(json.dumps({"what": what, "wall_ms_per_step": round(wall_s * 1e3 / steps, 1),
                      "kernel_ms_per_step": round(total / steps, 1),
                      "top": [[name, round(ms / steps, 2)] for name, ms in ranked]}), flush=True)
    return {name: ms / steps for name, ms in per_kernel.items()}


def _profiled(step_fn, steps: int):
    for i in range(3):
        step_fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for i in range(steps):
            step_fn(3 + i)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return prof, wall


def plain(steps: int, top: int) -> dict[str, float]:
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(**UNET_PRESETS["sdxl"]).to("cuda").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    inp = _inputs(8, "cuda")

    def step(_):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**inp).sample
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    prof, wall = _profiled(step, steps)
    kernels = _summarise("plain", prof, steps, wall, top)
    del model, opt
    torch.cuda.empty_cache()
    return kernels


def diffpipe(config_path: str, sets: list[str], steps: int, top: int) -> dict[str, float]:
    config = load_config(config_path, ["pipeline.stages=1", "pipeline.microbatches=1", "train.batch_size=8",
                                       "pipeline.checkpointing=\"none\"", "plan.memory_gib=139",
                                       "output.save_weights=false", *sets])
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29583")
    topo = init_topology(1, 1, resolve_device_kind(config.train.device))
    trainer = Trainer(config, topo, Path(tempfile.mkdtemp()))
    batches = {}

    def step(i):
        batch = batches.pop(i, None) or trainer.batch_for(i)
        loss, times = trainer.forward_backward(i, batch)
        batches[i + 1] = trainer.batch_for(i + 1)
        trainer.apply_gradients(i, loss, times)

    prof, wall = _profiled(step, steps)
    return _summarise("diffpipe", prof, steps, wall, top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    mine = diffpipe(args.config, args.set, args.steps, args.top)
    gc.collect()  # the trainer's modules, so the plain loop has the GPU's memory
    torch.cuda.empty_cache()
    theirs = plain(args.steps, args.top)
    diff = {k: mine.get(k, 0.0) - theirs.get(k, 0.0) for k in set(mine) | set(theirs)}
    ranked = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.top]
    print(json.dumps({"what": "diffpipe minus plain, ms per step", "kernels": [[k, round(v, 2)] for k, v in ranked]}),
          flush=True)


if __name__ == "__main__":
    main()
