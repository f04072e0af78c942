"""Data-parallel replicas of each stage on torch's composable data parallelism, as torchtitan composes it with
pipelines: every stage module of a process is wrapped by `fully_shard` (FSDP2: parameters, gradients and AdamW
state cut across the replicas, `pipeline.data_parallel_shard = true`) or by `replicate` (every replica holding
everything: gradients all-reduced), each unit on its own. torch's pipeline schedules know both: they hold the
gradients back during the micro-batches' backwards and reduce them once, after the last (`perform_reduce_grad`),
averaged over the replicas, the whole weights gathered from the first forward to then.

A stage alone (pipeline.stages = 1) runs its micro-batches in a loop (runtime.PipelineRunner._accumulate), which
`before_backward` sets up. Replicated, it is wrapped by torch's DDP engine instead (composable `replicate` of
torch.distributed._composable, torchtitan's `apply_ddp`): its parameters stay plain tensors and the last micro-
batch's backward all-reduces the gradients in 25 MB buckets as they are made (FSDP2's replicate ran the SDXL UNet
well below DDP, its host behind the device; this engine runs at DDP's speed: docs/benchmarks.md, "Several GPUs";
torch's schedules cannot drive DDP across steps: docs/pipelining-facts.md). Sharded, each unit's whole weights
exist only while it computes (gathered for its forward and again for its backward) and every micro-batch's
gradients are reduced into the replica's part at once, so a replica holds its part of the model and one or two
units whole, as ZeRO-3 does: a model too large for one GPU trains on several without a pipeline, for three
collectives a micro-batch instead of two a step.

With FSDP2 each parameter becomes a DTensor over the replicas' mesh; `full` gives the whole tensor (a collective
over the replicas when sharded: every replica must call it, in the same order) and `local` this process's part;
a plain tensor is its own whole and part.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from ..config import ConfigError
from ..distributed import Topology
from ..torch_support import data_parallel_wrappers

__all__ = ["spread_over_replicas", "before_backward", "full", "local", "local_numel"]


def spread_over_replicas(modules: list[torch.nn.Module], topo: Topology, shard: bool) -> None:
    """Wrap this process's stage modules for its replicas (nothing with one data-parallel replica: the processes
    sharing each sample's tokens alone average their gradients without wrappers, pipeline/sequence.py's
    `average_over_shares`, which block swap allows). Call it once the modules are
    on their device and before anything keeps their parameters (optimizer, hooks, tied-weight maps): FSDP2's
    wrapping replaces every Parameter by a DTensor one."""
    if topo.dp_size == 1:
        return
    if _share_a_weight(modules):
        raise ConfigError(
                    "pipeline.data_parallel > 1 with a weight shared by two stages of one process (this layout of "
                    "pipeline.schedule / pipeline.virtual_stages puts both users of a tied weight on one process): "
                    "torch's data parallelism wraps each stage alone and cannot hold one weight in two. Use "
                    "pipeline.schedule = \"1f1b\" or \"gpipe\", or pipeline.data_parallel = 1")
    # a stage alone (the planner's `stages == 1`): its own loop runs the micro-batches (runtime._accumulate)
    alone = topo.pp_size == 1 and len(modules) == 1
    if alone and not shard:  # the module's docstring says why DDP's engine
        data_parallel_wrappers()["ddp_replicate"](modules[0], device_id=topo.device, process_group=topo.dp_group,
                           gradient_as_bucket_view=True)
        return
    mesh = DeviceMesh.from_group(topo.dp_group, topo.device.type)
    replicate = data_parallel_wrappers()["fsdp_replicate"]

    def wrap(part: torch.nn.Module, gathered_per_use: bool) -> None:
        if shard:
            fully_shard(part, mesh=mesh, reshard_after_forward=gathered_per_use)
        else:
            replicate(part, mesh=mesh)

    for module in modules:
        # in a pipeline, whole copies of the weights are kept from a step's first forward to its end (torch's
        # schedules do the same for every wrapped module): each micro-batch would otherwise gather them again
        for part in _parts_wrapped_alone(module):
            wrap(part, gathered_per_use=alone)
        wrap(module, gathered_per_use=False)


def before_backward(module: torch.nn.Module, last: bool) -> None:
    """Set up a stage alone for the backward of a micro-batch (`last`: of the step's last), as the module's
    docstring says; nothing for a module without replicas. Call it before the micro-batch's forward (DDP reads it
    there)."""
    wrappers = data_parallel_wrappers()
    if isinstance(module, wrappers["DDPModule"]):
        module.set_requires_gradient_sync(last)
        return
    if not isinstance(module, FSDPModule):
        return
    reduce_now = last or not isinstance(module, wrappers["ReplicateModule"])
    module.set_requires_gradient_sync(reduce_now)
    module.set_reshard_after_backward(reduce_now)
    module.set_is_last_backward(last)


def _parts_wrapped_alone(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The parts of a stage wrapped on their own: its units with weights. Each part's gradients are reduced as soon
    as its backward ends, overlapping the backward of the units before it. (Wrapping each transformer block too, 94
    parts for the SDXL UNet instead of 24, measured slower on two H200s: 26.99 samples/s against 29.43.) A weight
    belongs to one wrapped part: if two units share one (a norm tied between a DiT's first and last units), the
    stage is wrapped whole."""
    parts = [u for u in getattr(module, "units", []) if any(True for _ in u.parameters())]
    return [] if _share_a_weight(parts) else parts


def _share_a_weight(modules: list[torch.nn.Module]) -> bool:
    """Whether a parameter belongs to two of the modules (which torch's data parallelism cannot wrap apart)."""
    owner: dict[int, int] = {}
    return any(owner.setdefault(id(p), index) != index
               for index, module in enumerate(modules) for p in module.parameters())


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered from the replicas when sharded; collective then)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of the tensor (the tensor itself when not a DTensor): in-place changes reach it."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_numel(like: torch.Tensor | None, shape: tuple[int, ...], topo: Topology, shard: bool) -> int:
    """Elements this process holds of a parameter of `shape` (from `like`, one it holds, or computed as FSDP2 cuts
    dim 0: torch.chunk over the replicas)."""
    if like is not None:
        return local(like).numel()
    if not shard or topo.dp_size == 1 or not shape:
        return int(torch.Size(shape).numel())
    rows = [len(part) for part in torch.empty(shape[0], device="meta").chunk(topo.replicas)]
    mine = rows[topo.replica_rank] if topo.replica_rank < len(rows) else 0
    return mine * int(torch.Size(shape[1:]).numel())
