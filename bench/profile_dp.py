"""Where the GPU time of a data-parallel step goes: diffpipe's data parallelism (one stage, its replicas on torch's
`replicate`, or `fully_shard` with --set pipeline.data_parallel_shard=true) against torch DDP's reference loop
(bench/reference/ddp_loop_gpu.py: the same UNet, micro-batch 8, the same accumulation), both under
torch.profiler in the same processes, one after the other. Run under torchrun:

    torchrun --standalone --nproc-per-node 2 bench/profile_dp.py examples/sdxl_unet.toml [--steps 4] [--batch 64]
             [--set KEY=VALUE ...] [--out FILE]

Prints (and appends to --out) one JSON line per loop from rank 0: per steady step, the GPU's span, the time its
compute kernels keep it busy, the time NCCL kernels run and how much of it no compute kernel overlaps (exposed),
the idle time, the largest idle gaps with the kernels on either side, the kernels that take most; then the
kernels whose time differs most between the two. Steps are told apart by the fused AdamW kernels that end each;
the first 3 are left out.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from diffpipe.config_files import load_config  # noqa: E402
from diffpipe.distributed import init_topology, resolve_device_kind  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402
from profile_step import WARMUP, _kernels, _step_ends  # noqa: E402

MICRO = 8


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _covered(interval: tuple[float, float], union: list[tuple[float, float]]) -> float:
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


def summarise(what: str, prof, top: int) -> tuple[dict, dict[str, float]]:
    """The loop's row, and each kernel's milliseconds per step."""
    kernels = _kernels(prof)
    ends = _step_ends(kernels)[WARMUP - 1:]
    if len(ends) < 2:
        return {"what": what, "error": f"found {len(ends)} step ends among {len(kernels)} kernels"}, {}
    first, last, steps = ends[0], ends[-1], len(ends) - 1
    window = [k for k in kernels if first < k[0] and k[1] <= last]
    nccl = [(s, e) for s, e, n in window if "nccl" in n.lower()]
    compute = _union([(s, e) for s, e, n in window if "nccl" not in n.lower()])
    busy = sum(b - a for a, b in compute)
    nccl_total = sum(e - s for s, e in nccl)
    exposed = sum((e - s) - _covered((s, e), compute) for s, e in _union(nccl))
    gaps, reach, before = [], first, "(previous step's optimizer)"
    for start, end, name in window:
        if "nccl" in name.lower():
            continue
        if start > reach:
            gaps.append((start - reach, before, name))
        if end > reach:
            reach, before = end, name
    gaps.sort(reverse=True)
    per_kernel: dict[str, float] = defaultdict(float)
    for start, end, name in window:
        per_kernel[name] += (end - start) / 1e3 / steps
    ms = lambda us: round(us / 1e3 / steps, 2)  # noqa: E731
    row = {"what": what, "steps": steps, "gpu_span_ms_per_step": ms(last - first), "compute_busy_ms": ms(busy),
           "compute_idle_ms": ms(last - first - busy), "nccl_ms": ms(nccl_total), "nccl_exposed_ms": ms(exposed),
           "largest_gaps_ms": [[round(g / 1e3, 3), a, b] for g, a, b in gaps[:top]],
           "top": [[n, round(v, 2)] for n, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]]}
    return row, dict(per_kernel)


def diffpipe_loop(config_path: str, sets: list[str], batch: int, steps: int, top: int):
    world = int(os.environ["WORLD_SIZE"])  # torchrun's; the process group starts in init_topology below
    config = load_config(config_path, ["pipeline.stages=1", f"pipeline.data_parallel={world}",
                                       f"pipeline.microbatches={batch // (MICRO * world)}", f"train.batch_size={batch}",
                                       "pipeline.checkpointing=\"none\"", "plan.memory_gib=139",
                                       f"train.max_steps={WARMUP + steps}", "output.save_weights=false",
                                       "output.sample_every_end=false", "observe.enabled=false", *sets])
    topo = init_topology(1, world, resolve_device_kind(config.train.device))
    run_dir = Path(tempfile.gettempdir()) / "profile_dp"
    trainer = Trainer(config, topo, run_dir)
    activity = ProfilerActivity.CUDA if topo.device.type == "cuda" else ProfilerActivity.CPU  # CPU: a dry run
    with profile(activities=[activity]) as prof:
        trainer.fit()
        if topo.device.type == "cuda":
            torch.cuda.synchronize()
    out = summarise("diffpipe " + ("fully_shard" if config.pipeline.data_parallel_shard else "replicate"), prof, top)
    del trainer, prof
    return out


def ddp_loop(batch: int, steps: int, top: int):
    from diffusers import UNet2DConditionModel
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(ROOT / "bench" / "reference"))
    from plain_loop_gpu import SDXL, sdxl_inputs

    rank, world = dist.get_rank(), dist.get_world_size()
    acc = max(1, batch // (MICRO * world))
    torch.manual_seed(0)
    model = DDP(UNet2DConditionModel(**SDXL).cuda().train(), device_ids=[rank % torch.cuda.device_count()],
                gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    inp = sdxl_inputs(MICRO, 1024)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(WARMUP + steps):
            for i in range(acc):
                with model.no_sync() if i < acc - 1 else torch.enable_grad():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(**inp).sample.float().pow(2).mean() / acc
                    loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    out = summarise("torch DDP", prof, top)
    del model, opt, prof
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    mine, my_kernels = diffpipe_loop(args.config, args.set, args.batch, args.steps, args.top)
    gc.collect()
    torch.cuda.empty_cache()
    theirs, their_kernels = ddp_loop(args.batch, args.steps, args.top)
    diff = {k: my_kernels.get(k, 0.0) - their_kernels.get(k, 0.0) for k in set(my_kernels) | set(their_kernels)}
    ranked = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.top]
    rows = [mine, theirs, {"what": "diffpipe minus DDP, kernel ms per step",
                           "kernels": [[k, round(v, 2)] for k, v in ranked]}]
    if dist.get_rank() == 0:
        for row in rows:
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
