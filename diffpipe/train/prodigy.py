"""Prodigy (Mishchenko & Defazio, "Prodigy: An Expeditiously Adaptive Parameter-Free Learner", 2023): Adam whose
step size D is estimated from the run itself, so `train.learning_rate` is a multiplier of it (1.0 as users set it).

The arithmetic is prodigyopt 1.1.2's `Prodigy` (the package kohya's and SimpleTuner's users train with), which
`tests/train/test_optimizers.py` compares with this one step by step. It is written again here for one reason: D
comes from two sums over *every* trained weight of the model (<g, p0 - p> and |s|), and on a pipeline each process
holds only its stages' weights. prodigyopt sums across processes only for FSDP, over the whole world, on `.cuda()`
tensors: on a pipeline it would estimate D from one stage's weights (each stage its own D, unlike the unsplit
model), or, on CPU, fail. Here the two sums are all-reduced over the pipeline's processes (the replicas of a stage
hold the same weights and gradients, so not over those), a tied weight held by two processes is counted once, and
they are read on the host once a step instead of twice per weight.

Not prodigyopt's `slice_p` (D from every p-th element) nor its coupled weight decay; p0 is kept whole even where a
weight starts at zero (prodigyopt keeps a scalar there), so a checkpoint's shapes never depend on the values.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..pipeline.data_parallel import local

__all__ = ["Prodigy", "PRODIGY_STATE_KEYS", "ESTIMATE_KEYS"]

PRODIGY_STATE_KEYS = ("s", "p0", "exp_avg", "exp_avg_sq", "step")  # each trained weight's, in a checkpoint
ESTIMATE_KEYS = ("d", "d_max", "d_numerator", "k")  # the run's, one value each, the same on every process


class Prodigy(torch.optim.Optimizer):
    """prodigyopt 1.1.2's Prodigy (decoupled weight decay) over the weights of this process, with D estimated over
    the weights of every process of `reduce_group` (None: this process alone). `not_counted` holds the ids of
    weights another process counts (the second copy of a tied weight)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0,
                 d0: float = 1e-6, d_coef: float = 1.0, growth_rate: float = math.inf, beta3: float | None = None,
                 use_bias_correction: bool = False, safeguard_warmup: bool = False,
                 reduce_group: dist.ProcessGroup | None = None, not_counted: frozenset[int] = frozenset()):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.d0, self.d_coef, self.growth_rate = d0, d_coef, growth_rate
        self.beta3 = beta3 if beta3 is not None else math.sqrt(betas[1])
        self.use_bias_correction, self.safeguard_warmup = use_bias_correction, safeguard_warmup
        self.reduce_group, self.not_counted = reduce_group, not_counted
        self.estimate = {"d": d0, "d_max": d0, "d_numerator": 0.0, "k": 0}

    def init_weight_state(self, p: torch.nn.Parameter) -> None:
        """`p`'s state as its first step creates it (also before a checkpoint is loaded into it)."""
        state, weight = self.state[p], local(p)
        state["step"] = 0
        state["s"] = torch.zeros_like(weight)
        state["p0"] = weight.detach().clone()
        state["exp_avg"] = torch.zeros_like(weight)
        state["exp_avg_sq"] = torch.zeros_like(weight)

    def _sums(self, numerator: list[torch.Tensor], denominator: list[torch.Tensor], device) -> tuple[float, float]:
        """The step's two sums over every process's weights: one all-reduce and one read on the host."""
        def total(terms: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack(terms).double().sum() if terms else torch.zeros((), dtype=torch.float64, device=device)

        both = torch.stack([total(numerator), total(denominator)])
        if self.reduce_group is not None:
            dist.all_reduce(both, group=self.reduce_group)
        numerator_sum, denominator_sum = both.tolist()
        return numerator_sum, denominator_sum

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "diffpipe's trainer computes the loss itself"
        e = self.estimate
        beta1, beta2 = self.defaults["betas"]
        lr = max(group["lr"] for group in self.param_groups)
        d, k = e["d"], e["k"]
        bias_correction = (math.sqrt(1 - beta2 ** (k + 1)) / (1 - beta1 ** (k + 1))) if self.use_bias_correction else 1.0
        dlr = d * lr * bias_correction
        weights = [(p, local(p), local(p.grad)) for group in self.param_groups for p in group["params"]
                   if p.grad is not None]
        numerator, denominator = [], []
        for p, weight, grad in weights:
            state = self.state[p]
            if "step" not in state:
                self.init_weight_state(p)
            if lr > 0:
                counted = id(p) not in self.not_counted
                if counted:
                    dot = torch.dot(grad.flatten(), (state["p0"] - weight).flatten()).double()
                    numerator.append(dot * ((d / self.d0) * dlr))  # in float64, as prodigyopt's .item()
                if beta1 > 0:
                    state["exp_avg"].mul_(beta1).add_(grad, alpha=d * (1 - beta1))
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=d * d * (1 - beta2))
                state["s"].mul_(self.beta3).add_(grad, alpha=(d / self.d0) * (d if self.safeguard_warmup else dlr))
                if counted:
                    denominator.append(state["s"].abs().sum())
        device = weights[0][1].device if weights else torch.device("cpu")
        delta_numerator, d_denom = self._sums(numerator, denominator, device)
        if d_denom == 0:  # no gradient anywhere: prodigyopt leaves D and the weights as they are
            return None
        d_numerator = e["d_numerator"] * self.beta3 + delta_numerator
        if lr > 0:
            d_hat = self.d_coef * d_numerator / d_denom
            d_max = max(e["d_max"], d_hat)
            d = min(d_max, (max(d, d_hat) if d == self.d0 else d) * self.growth_rate)
            e.update(d=d, d_max=d_max)
        e["d_numerator"] = d_numerator
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state, weight, grad = self.state[p], local(p), local(p.grad)
                state["step"] += 1
                denom = state["exp_avg_sq"].sqrt().add_(d * group["eps"])
                if group["weight_decay"]:
                    weight.add_(weight, alpha=-group["weight_decay"] * dlr)
                if beta1 > 0:
                    weight.addcdiv_(state["exp_avg"], denom, value=-dlr)
                else:
                    weight.addcdiv_(grad, denom, value=-dlr * d)
        e["k"] = k + 1
        return None
