"""AdamW with warm-up and a cosine or constant schedule; gradient clipping and fp16 loss scaling across the
processes of a pipeline (the replicas' gradients are averaged by torch's data parallelism: pipeline/data_parallel.py).

AdamW's moments are fp32 (torch's fused AdamW), or 8-bit (memory.optimizer_state = "8bit": bitsandbytes' AdamW8bit,
the moments quantised block-wise to 8 bits with an fp32 scale per 256 values: 2 bytes a parameter instead of 8).
bitsandbytes rather than torchao's AdamW8bit: its state is plain tensors (uint8 moments, fp32 block scales) that a
checkpoint saves by name and resumes bit-equal, its CPU kernels run the tests without compiling, and kohya,
SimpleTuner and diffusion-pipe users know it; torchao's state is a tensor subclass compiled per parameter shape
(6 s for one on a CPU) that safetensors cannot hold. Its kernels need whole tensors, so not with FSDP2's shards.

Each pipeline rank holds different parameters, so the global gradient norm is the square root of the sum of
every rank's squared norms (all-reduced over the pipeline group). The norm is also the overflow test of the
fp16 loss scaler: every rank sees the same norm, so every stage makes the same skip decision.

`train.optimizer` may instead be Adafactor (transformers' `Adafactor`, as kohya and OneTrainer users train with it:
the second moment factored into a row and a column mean per matrix, no first moment; each weight's update depends
on that weight alone, so a pipeline computes what the unsplit model does) or Prodigy (train/prodigy.py: its step
size is estimated over every weight of the model, summed across the pipeline's processes).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..pipeline.data_parallel import full
from ..torch_support import scale_in_place
from .prodigy import ESTIMATE_KEYS, PRODIGY_STATE_KEYS, Prodigy

__all__ = ["make_optimizer", "lr_factor", "LossScaler", "global_grad_norm", "clip_gradients",
           "step_optimizer", "state_keys", "ensure_state", "state_tensors", "set_steps", "run_level_state",
           "set_run_level_state", "optimizer_note"]

# each trained parameter's optimizer state a checkpoint holds: AdamW's moments and step; 8-bit AdamW's quantised
# moments, their scales per block (absent for parameters under 4096 elements, whose moments stay fp32) and step;
# Adafactor's first moment (only with optimizer_args.beta1), its factored second moment (a matrix's row and column
# means) or, for a vector, the whole one, and step; Prodigy's (train/prodigy.py)
_STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq", "step"),
               "adamw-8bit": ("state1", "state2", "absmax1", "absmax2", "step"),
               "adafactor": ("exp_avg", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col", "step"),
               "prodigy": PRODIGY_STATE_KEYS}


def _kind(optimizer: torch.optim.Optimizer) -> str:
    if isinstance(optimizer, Prodigy):
        return "prodigy"
    if type(optimizer).__name__ == "Adafactor":
        return "adafactor"
    return "adamw-8bit" if _is_8bit(optimizer) else "adamw"


def state_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The names of a trained weight's optimizer state a checkpoint holds (those its state has)."""
    return _STATE_KEYS[_kind(optimizer)]


def lr_factor(step: int, train: TrainConfig) -> float:
    """Multiplier of the peak learning rate at `step` (0-based)."""
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.lr_schedule == "constant":
        return 1.0
    progress = (step - train.warmup_steps) / max(1, train.max_steps - train.warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(groups: list[tuple[list[torch.nn.Parameter], float]], train: TrainConfig, state: str = "fp32",
                   reduce_group=None, not_counted: frozenset[int] = frozenset()):
    """`train.optimizer` over (parameters, learning-rate multiplier) groups, one per stage, and its schedule: torch's
    fused AdamW (one kernel for all parameters, on CPUs too), with `state` "8bit" bitsandbytes' AdamW8bit; transformers'
    Adafactor; or Prodigy, its step size estimated over the weights of every process of `reduce_group` (the pipeline's),
    counting once the tied copies in `not_counted`."""
    param_groups = [{"params": params, "lr": train.learning_rate * scale} for params, scale in groups if params]
    args = dict(train.optimizer_args)
    adam = dict(lr=train.learning_rate, betas=tuple(train.betas), weight_decay=train.weight_decay, eps=train.adam_eps)
    if train.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        opt = Adafactor(param_groups, lr=train.learning_rate, weight_decay=train.weight_decay,
                        relative_step=False, warmup_init=False, scale_parameter=args.pop("scale_parameter", False),
                        **args)
    elif train.optimizer == "prodigy":
        opt = Prodigy(param_groups, **adam, reduce_group=reduce_group, not_counted=not_counted, **args)
    elif state == "8bit":
        import bitsandbytes

        opt = bitsandbytes.optim.AdamW8bit(param_groups, **adam)
    else:
        opt = torch.optim.AdamW(param_groups, **adam, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, train))
    return opt, sched


def optimizer_note(train: TrainConfig) -> str | None:
    """A line for the user where the learning rate looks meant for another optimizer: Prodigy's is a multiplier of
    the step size it finds (1.0), so an AdamW-sized one (1e-4) all but stops training."""
    if train.optimizer == "prodigy" and train.learning_rate < 0.1:
        return (f"note: train.optimizer = \"prodigy\" with train.learning_rate = {train.learning_rate:g}: Prodigy's "
                "learning rate multiplies the step size it estimates, and its users set 1.0 (0.5-2 to tune); this one "
                "makes every step that much smaller")
    return None


def _is_8bit(optimizer: torch.optim.Optimizer) -> bool:
    return hasattr(optimizer, "init_state")  # bitsandbytes' optimizers create a parameter's state with it


def ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state as its first step would create it, so a checkpoint can be loaded into it before any
    step."""
    kind = _kind(optimizer)
    for index, group in enumerate(optimizer.param_groups):
        on_device = group.get("fused") or group.get("capturable")
        for position, p in enumerate(group["params"]):
            state = optimizer.state[p]
            if state:
                continue
            if kind == "adamw-8bit":
                optimizer.init_state(group, p, index, position)
            elif kind == "prodigy":
                optimizer.init_weight_state(p)
            elif kind == "adafactor":  # as transformers' Adafactor.step creates it, in fp32
                _init_adafactor_state(state, p, group)
            else:
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if on_device
                                 else torch.tensor(0.0, dtype=torch.float32))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _init_adafactor_state(state: dict, p: torch.nn.Parameter, group: dict) -> None:
    shape, like = p.shape, dict(dtype=torch.float32, device=p.device)
    state["step"] = 0
    if group["beta1"] is not None:
        state["exp_avg"] = torch.zeros(shape, **like)
    if len(shape) >= 2:  # factored: a mean over the last dimension and one over the one before it
        state["exp_avg_sq_row"] = torch.zeros(shape[:-1], **like)
        state["exp_avg_sq_col"] = torch.zeros(shape[:-2] + shape[-1:], **like)
    else:
        state["exp_avg_sq"] = torch.zeros(shape, **like)
    state["RMS"] = 0  # the weight's root mean square, computed again at each step before use: not checkpointed


def state_tensors(optimizer: torch.optim.Optimizer, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """`p`'s optimizer state as tensors by `state_keys`' names (after `ensure_state`): the optimizer's own tensors,
    which a load fills in place; a step kept as a Python number (8-bit AdamW, Adafactor, Prodigy) as a new tensor
    (`set_steps` puts it back)."""
    state = optimizer.state[p]
    tensors = {key: state[key] for key in state_keys(optimizer) if key in state}
    if not isinstance(tensors["step"], torch.Tensor):
        tensors["step"] = torch.tensor(state["step"], dtype=torch.int64)
    return tensors


def set_steps(optimizer: torch.optim.Optimizer, steps: dict[torch.nn.Parameter, torch.Tensor]) -> None:
    """Each parameter's step count from a checkpoint, where the optimizer keeps it as a number."""
    for p, step in steps.items():
        if not isinstance(optimizer.state[p]["step"], torch.Tensor):
            optimizer.state[p]["step"] = int(step)


def run_level_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """What the optimizer keeps for the whole run rather than per weight, by checkpoint name: Prodigy's step-size
    estimate (the same on every process); nothing for the others."""
    if not isinstance(optimizer, Prodigy):
        return {}
    return {f"progress.prodigy_{key}": torch.tensor(float(optimizer.estimate[key]), dtype=torch.float64)
            for key in ESTIMATE_KEYS}


def set_run_level_state(optimizer: torch.optim.Optimizer, state: dict[str, torch.Tensor]) -> None:
    """Put back what `run_level_state` gave, as loaded from a checkpoint."""
    if isinstance(optimizer, Prodigy):
        optimizer.estimate.update({key: float(state[f"progress.prodigy_{key}"]) for key in ESTIMATE_KEYS})
        optimizer.estimate["k"] = int(optimizer.estimate["k"])


class LossScaler:
    """Dynamic loss scale for fp16: halve on overflow (the step is skipped), double after `growth_interval` good steps."""

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale /= 2
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2


def _grads(params) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def global_grad_norm(params, pp_group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """L2 norm of all gradients of all stages, as a 0-d tensor on `device` (one fused norm here, one all-reduce
    of its square); reading it on the host is the caller's choice, so the step need not wait for the device."""
    grads = _grads(params)
    # of DTensor gradients (replicas on torch's data parallelism): the norm over the replicas' parts, made whole
    local = full(torch.nn.utils.get_total_norm(grads)) if grads else torch.zeros((), device=device)
    sq = local.double().pow(2).to(device)
    dist.all_reduce(sq, group=pp_group)
    return sq.sqrt()


def clip_gradients(params, norm: torch.Tensor | None, max_norm: float, unscale: float = 1.0) -> torch.Tensor | None:
    """The factor gradients are multiplied by before the optimizer step: 1 / loss scale (fp16) times the clip
    factor, as a 0-d fp32 tensor on the gradients' device (None when it is 1: no clipping, no loss scale).

    The factor is computed on the device from `norm`, so clipping never waits for the host.
    """
    grads = _grads(params)
    if not grads or (max_norm <= 0 and unscale == 1.0):
        return None
    device = grads[0].device
    if max_norm > 0:
        return (torch.clamp(max_norm / (norm * unscale + 1e-6), max=1.0) * unscale).float().to(device)
    return torch.full((), unscale, dtype=torch.float32, device=device)  # a fill on the device: no host copy to wait on


def step_optimizer(optimizer: torch.optim.Optimizer, params, factor: torch.Tensor | None,
                   skip: torch.Tensor | None = None) -> None:
    """One optimizer step on the gradients times `factor` (from `clip_gradients`); none where `skip`, a 0-d
    float tensor on the device, is 1 (non-finite gradients): the fused kernel reads it there, as it reads
    torch.amp.GradScaler's `found_inf`, so skipping costs the host no wait.

    The fused AdamW divides each gradient by the optimizer's `grad_scale` tensor inside its own kernel (the
    contract torch.amp.GradScaler uses), which saves a read and a write of every gradient (for an SDXL UNet's
    2.6 B fp32 gradients, 20 GB of memory traffic a step). Other optimizers get one multiply over all gradients
    first.
    """
    if optimizer.defaults.get("fused"):
        if factor is not None:
            optimizer.grad_scale = 1.0 / factor
        if skip is not None:
            optimizer.found_inf = skip
        try:
            optimizer.step()
        finally:
            optimizer.__dict__.pop("grad_scale", None)
            optimizer.__dict__.pop("found_inf", None)
        return
    if skip is not None and bool(skip):  # other optimizers cannot skip on the device: the host reads it
        return
    if factor is not None:
        scale_in_place(_grads(params), factor)  # one fused kernel per dtype/device
    optimizer.step()
