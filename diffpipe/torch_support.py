"""The torch versions diffpipe is tested on, and its one door to torch's private APIs.

Nothing else in diffpipe reaches into a `torch.*._name`: it calls a function here. Each one imports what it needs
when first called and, where the installed torch lacks it, raises `TorchVersionError` with a sentence that names
what is missing and which torch to install, never a traceback from inside torch. Where tested versions behave
differently (torch 2.11's split backward refuses an input the outputs do not use; 2.13 tolerates it), the
difference is handled here, once.

Tested: every minor version in `TESTED` runs the whole suite (2.13, `.ci/run`) or its smoke subset
(`tests/test_torch_versions.py`, run by `.ci/run` under each other version in a venv of its own).
"""
from __future__ import annotations

import functools
import importlib
from typing import Iterator

import torch

from .errors import TorchVersionError

__all__ = ["TESTED", "TorchVersionError", "check_torch", "schedule_problem", "split_backward_input", "split_backward_weight",
           "kept_storage_key", "view_base", "schedule_actions", "data_parallel_wrappers", "recompile_limit",
           "scale_in_place", "fused_attention", "non_persistent_buffers", "move_lr_schedule", "foreach",
           "scaled_matmul", "fp8_matmul_problem", "hook_counts"]

TESTED = ("2.11", "2.13")  # minor versions the suite runs on; pyproject's range spans them
_INSTALL = "pip install 'torch==2.13.0'"


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch(version: str | None = None) -> str | None:
    """Refuse a torch older than the oldest tested one; return a warning for one newer than the newest, else None."""
    version = version or torch.__version__
    found, oldest, newest = _minor(version), _minor(TESTED[0]), _minor(TESTED[-1])
    if found < oldest:
        raise TorchVersionError(f"diffpipe needs torch {TESTED[0]} or newer (tested: {', '.join(TESTED)}); this "
                                f"is torch {version}: {_INSTALL}")
    if found > newest:
        return (f"torch {version} is newer than the versions diffpipe is tested on ({', '.join(TESTED)}); if "
                f"something fails inside torch, {_INSTALL}")
    return None


def schedule_problem(schedule: str, stage_placement: str, device_kind: str, version: str | None = None) -> str | None:
    """Why this torch cannot run a schedule on this device's backend, in the config's words; None when it can.

    Before 2.13, torch's multi-stage schedules open their first step by sending a tensor from each stage to its
    neighbours; a V-shaped placement puts two neighbouring stages on one process, and gloo (CPU) cannot send from a
    process to itself ("Pair is not connected"). NCCL can (zbv and dualpipev ran on two H200s under torch 2.11).
    """
    version = version or torch.__version__
    if stage_placement == "v" and device_kind == "cpu" and _minor(version) < (2, 13):
        return (f"pipeline.schedule = {schedule!r} on CPU needs torch 2.13 or newer: torch {version}'s V-shaped "
                "schedules send a tensor from a process to itself at their first step, which gloo cannot. Use "
                f"\"zb1p\" or \"interleaved_1f1b\" on CPU, or {_INSTALL}")
    return None


def _missing(what: str, used_for: str) -> TorchVersionError:
    return TorchVersionError(f"torch {torch.__version__} has no {what}, which diffpipe uses for {used_for}; "
                             f"diffpipe is tested on torch {', '.join(TESTED)}: {_INSTALL}")


def _private(module: str, name: str, used_for: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _missing(f"{module}.{name}", used_for) from None


def _reached_by(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inputs whose gradient the outputs' autograd graph reaches (torch 2.11 refuses the others)."""
    nodes = [torch.autograd.graph.get_gradient_edge(t).node for t in inputs]
    seen, todo = set(), [o.grad_fn for o in outputs if o.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(child for child, _ in node.next_functions)
    return [t for t, node in zip(inputs, nodes) if node in seen]


def split_backward_input(outputs: list[torch.Tensor], output_grads: list[torch.Tensor],
                         inputs: list[torch.Tensor], weights: Iterator[torch.nn.Parameter]) -> list[dict]:
    """The input-gradient pass of torch's zero-bubble schedules (`pipelining._backward.stage_backward_input`);
    returns the parameter groups its weight pass needs. Inputs the outputs do not use are left out."""
    run = _private("torch.distributed.pipelining._backward", "stage_backward_input", "the planner's count of what a "
                   "zero-bubble schedule keeps for its weight pass")
    used = _reached_by(outputs, [t for t in inputs if t.requires_grad])
    _, groups = run(outputs, output_grads, used, weights)
    return groups


def split_backward_weight(weights: Iterator[torch.nn.Parameter], groups: list[dict]) -> None:
    """The weight-gradient pass that follows `split_backward_input`."""
    _private("torch.distributed.pipelining._backward", "stage_backward_weight", "the planner's count of what a "
             "zero-bubble schedule keeps for its weight pass")(weights, groups)


def kept_storage_key(tensor: torch.Tensor) -> int:
    """One key per storage, also on the meta device, where every storage's data pointer is 0."""
    return tensor.untyped_storage()._cdata


def dispatch_mode_class():
    """torch's base class for a mode that sees every aten op below autograd (the planner's count of live memory)."""
    return _private("torch.utils._python_dispatch", "TorchDispatchMode", "the planner's count of working memory")


def view_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a view was made from (itself where it is no view)."""
    return tensor._base if tensor._base is not None else tensor


def schedule_actions(torch_type, ranks: int, microbatches: int, stages_per_rank: int) -> list:
    """Each rank's actions of a multi-stage schedule, as torch itself orders them."""
    get_ops = _private("torch.distributed.pipelining._schedule_visualizer", "get_schedule_ops",
                       "the order of a multi-stage schedule's actions")
    return get_ops(torch_type, ranks, microbatches, stages_per_rank)


@functools.lru_cache(maxsize=1)
def data_parallel_wrappers() -> dict:
    """torch's composable data parallelism: DDP (`replicate`) and replicas of FSDP2's engine
    (`replicate_with_fsdp`), by name."""
    used_for = "data parallelism over pipeline replicas"
    return {"ddp_replicate": _private("torch.distributed._composable.replicate", "replicate", used_for),
            "DDPModule": _private("torch.distributed._composable.replicate", "DDP", used_for),
            "fsdp_replicate": _private("torch.distributed._composable.replicate_with_fsdp", "replicate", used_for),
            "ReplicateModule": _private("torch.distributed._composable.replicate_with_fsdp", "ReplicateModule",
                                        used_for)}


def recompile_limit(graphs: int):
    """A context in which dynamo keeps up to `graphs` compiled graphs per code object (its default is 8)."""
    config = _private("torch._dynamo", "config", "compiled stages")
    if not hasattr(config, "recompile_limit"):
        raise _missing("torch._dynamo.config.recompile_limit", "compiled stages")
    return config.patch(recompile_limit=graphs)


def scale_in_place(tensors: list[torch.Tensor], factor: float) -> None:
    """Every tensor times `factor`, one fused kernel per dtype and device."""
    if tensors:
        _private("torch", "_foreach_mul_", "scaling gradients")(tensors, factor)


def lerp_in_place(tensors: list[torch.Tensor], toward: list[torch.Tensor], weight: torch.Tensor) -> None:
    """Each tensor moved `weight` (a 0-d tensor, read on the device) of the way toward its partner, one fused kernel
    per dtype and device."""
    if tensors:
        _private("torch", "_foreach_lerp_", "the moving average of trained weights")(tensors, toward, weight)


def foreach(op: str, used_for: str):
    """torch's multi-tensor op `_foreach_<op>` (one fused kernel per dtype and device for a list of tensors):
    `foreach("addcmul_", "Prodigy's step")(moments, grads, grads, value=...)`."""
    return _private("torch", f"_foreach_{op}", used_for)


def fused_attention(query, key, value, dropout_p: float, is_causal: bool, scale) -> torch.Tensor:
    """Attention as the fused memory-efficient kernel computes it (its meta kernel saves what that kernel saves)."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
    if op is None:
        raise _missing("aten._scaled_dot_product_efficient_attention", "the planner's count of attention")
    return op(query, key, value, None, True, dropout_p, is_causal, scale=scale)[0]


def non_persistent_buffers(module: torch.nn.Module) -> set[str]:
    """Names of the module's own buffers that its state dict leaves out."""
    names = getattr(module, "_non_persistent_buffers_set", None)
    if names is None:
        raise _missing("nn.Module._non_persistent_buffers_set", "building a model on the meta device")
    return set(names)


def hook_counts(module: torch.nn.Module) -> tuple[int, ...]:
    """How many forward, forward-pre, backward and backward-pre hooks the module itself holds."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    if not all(hasattr(module, kind) for kind in kinds):
        raise _missing("nn.Module's hook dictionaries", "planning (repeated blocks counted once)")
    return tuple(len(getattr(module, kind)) for kind in kinds)


def move_lr_schedule(schedule: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer,
                     steps: int) -> None:
    """The learning-rate schedule at `steps` taken, and every group's learning rate with it."""
    lrs = [base * factor(steps) for base, factor in zip(schedule.base_lrs, schedule.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    state = schedule.state_dict()
    if "_last_lr" not in state or "last_epoch" not in state:
        raise _missing("last_epoch and _last_lr in an LR scheduler's state", "resuming")
    state.update(last_epoch=steps, _last_lr=lrs)  # the keys of torch's own state dict of a scheduler
    schedule.load_state_dict(state)


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) in `dtype` on fp8 tensor cores: a (M, K) row-major and b (K, N) column-major in
    fp8, scale_a (M, 1) and scale_b (1, N) in fp32 (one scale per row of a, per column of b; `torch._scaled_mm`)."""
    op = getattr(torch, "_scaled_mm", None)  # looked up where it runs: torch.compile traces through this
    if op is None:
        raise _missing("torch._scaled_mm", "fp8 compute (train.fp8_compute)")
    return op(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=dtype)


def fp8_matmul_problem(device: torch.device, try_product: bool = True) -> str | None:
    """Why this torch cannot run fp8 products with a scale per row on `device`, in one line; None when it can.

    Rowwise scales need an fp8 GPU (Ada, Hopper, Blackwell: compute capability 8.9 or more) and a torch whose kernels
    for it have them; torch's CPU kernel has them from 2.13 (2.11's takes one scale per tensor only). With
    `try_product` a product is tried on the device (on a GPU that starts its CUDA context: a launcher that only
    checks leaves it to the processes that train)."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return (f"train.fp8_compute needs a GPU with fp8 tensor cores (Ada, Hopper or Blackwell: RTX 4090, L40S, "
                f"H100 and later); {name} has none: set train.fp8_compute = false")
    if not try_product:
        return None
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    try:
        scaled_matmul(a, a.t(), torch.ones(16, 1, device=device), torch.ones(1, 16, device=device), torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return (f"train.fp8_compute: torch {torch.__version__} cannot run fp8 products with a scale per row on "
                f"{name}: set train.fp8_compute = false" + (f", or {_INSTALL}" if device.type == "cpu" else ""))
    return None
