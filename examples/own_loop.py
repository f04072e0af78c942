"""diffpipe inside a training loop of your own: a diffusers Flux transformer described as units, planned into two
stages, built as stage modules, and trained for a few steps with torch's own pipelining schedule (two processes,
gloo on CPU; NCCL on GPUs the same way). Run by hand:

    python examples/own_loop.py          # prints each step's loss, and the loss of the unsplit model on the same batch
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import FluxTransformer2DModel
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from diffpipe import describe, feed_of, plan_split, stage_modules

CONFIG = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))


def batch(feed, n: int = 4):
    """Latents (4 channels, 16 x 16) with text: in the layout the backbone reads, and the flow-matching target."""
    gen = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(n, 4, 16, 16, generator=gen), torch.randn(n, 4, 16, 16, generator=gen)
    t = torch.rand(n, generator=gen)
    conditions = feed.conditions(torch.randn(n, 8, 32, generator=gen), torch.randn(n, 32, generator=gen),
                                 torch.zeros(n, 6), (16, 16))
    conditions["timestep"] = t * 1000
    noisy = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
    return feed.pack(noisy), conditions, feed.pack_prediction(noise - x0)


def worker(rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**CONFIG)  # your model, loaded as you load it
    backbone = describe(model)
    sample, conditions, target = batch(feed_of(backbone))
    starts = plan_split(model, stages=2, sample=sample[:2], conditions={k: v[:2] for k, v in conditions.items()})
    stage = stage_modules(backbone, starts)[rank]  # this process's stage (the other's weights are never touched)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    loss_fn = lambda out, tgt: torch.nn.functional.mse_loss(out, tgt)  # noqa: E731
    schedule = Schedule1F1B(PipelineStage(stage, rank, 2, torch.device("cpu")), n_microbatches=2, loss_fn=loss_fn)
    for step in range(3):
        losses = []
        if rank == 0:
            schedule.step(sample, **conditions)
        else:
            schedule.step(target=target, losses=losses, **conditions)
            print(f"step {step}: pipelined loss {torch.stack(losses).mean().item():.6f}")
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


def main() -> None:
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**CONFIG)
    backbone = describe(model)
    sample, conditions, target = batch(feed_of(backbone))
    with torch.no_grad():
        unsplit = torch.nn.functional.mse_loss(backbone.forward({"sample": sample}, conditions), target)
    print(f"unsplit model's loss on the batch before training: {unsplit.item():.6f}")
    mp.spawn(worker, nprocs=2)


if __name__ == "__main__":
    main()
