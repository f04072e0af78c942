"""What a run does besides training steps, through the training pipeline itself: the eval loss on held-out data at
fixed timesteps, and samples during training.

Both run forward passes through every stage (`PipelineRunner.forward_only`, no gradients), so no process gathers
weights and a model split because it does not fit one device samples as it trains. Every process of the run takes
part; only the main process writes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import seeds
from ..config import RunConfig
from ..data.batches import fixed_batches
from ..data.sources import source_of
from ..grids import save_grid
from ..sampling import Generator, grid_controls, grid_prompts

__all__ = ["evaluate", "held_out_data", "write_samples"]


def held_out_data(config: RunConfig, data):
    """The eval split when train.eval_every asks for one: the folder's, or the digits never trained on."""
    return source_of(config).held_out(config, data) if config.train.eval_every else None


def evaluate(trainer) -> dict[str, float]:
    """The mean loss over every held-out item at each of `train.eval_quantiles` of the timestep density, with the
    same noise every time: `eval_loss` (their mean) and `eval_loss_t<q>` each."""
    train, topo = trainer.config.train, trainer.topo
    batches = fixed_batches(trainer.held_out, train.batch_size)
    sums = torch.zeros(len(train.eval_quantiles), dtype=torch.float64, device=topo.device)
    for b, indices in enumerate(batches):  # each batch at the quantiles of the density its size trains with
        at_each_t = trainer.batches.make_fixed(trainer.held_out, indices, seeds.of_step(train.seed, b),
                                               topo.dp_rank, topo.dp_size)
        for q, batch in enumerate(at_each_t):
            batch = batch.to(topo.device)
            _, loss = trainer.runner.forward_only(batch.noisy, batch.conditions, batch.target)
            if loss is not None:
                sums[q] += loss.double() / trainer.scaler.scale
    dist.all_reduce(sums)  # the loss lives on each replica's last stage
    per_quantile = (sums / (len(batches) * topo.replicas)).tolist()  # sequence shards: equal parts
    record = {"eval_loss": sum(per_quantile) / len(per_quantile)}
    record.update({f"eval_loss_t{q:.2f}": v for q, v in zip(train.eval_quantiles, per_quantile)})
    return record


def _pipeline_forward(trainer):
    """(x, conditions) -> the backbone's output on every process of this replica's pipeline: padded to a whole number
    of micro-batches, forwarded through the stages, sent from the last stage to the others."""
    topo, microbatches = trainer.topo, trainer.config.pipeline.microbatches

    def forward(x: torch.Tensor, conditions: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        rows = torch.arange(-(-n // microbatches) * microbatches, device=x.device) % n
        out, _ = trainer.runner.forward_only(x[rows], {k: v[rows] for k, v in conditions.items()}, like[rows],
                                            with_loss=False)
        out = out.float().contiguous() if out is not None else torch.empty(like[rows].shape, device=x.device)
        dist.broadcast(out, group_src=trainer.runner.last_stage_rank(), group=topo.pp_group)
        return out[:n]

    return forward


def write_samples(trainer, step: int) -> None:
    """RUN_DIR/samples/step-N.png (rows: sample.seeds; columns: the prompts) and the same grid in TensorBoard."""
    cfg, topo = trainer.config, trainer.topo
    prompts = grid_prompts(cfg, lambda: trainer.data.captions)
    generator = Generator(cfg, _pipeline_forward(trainer), trainer.text, trainer.feed, trainer.sample_shape,
                          trainer.vae)
    seeds = cfg.sample.seeds
    controls = grid_controls(cfg)
    images = generator.generate([p for _ in seeds for p in prompts], [s for s in seeds for _ in prompts],
                                cfg.sample.steps, cfg.sample.guidance_scale, decode=topo.is_main,
                                controls=[c for _ in seeds for c in controls] if controls else None)
    if topo.is_main:
        folder = trainer.run_dir / "samples"
        folder.mkdir(exist_ok=True)
        path = folder / f"step-{step + 1:06d}.png"
        path = save_grid(images, len(seeds), path, prompts, [f"seed {s}" for s in seeds])
        trainer.writers.add_image("samples", path, step)
