"""Prodigy (Mishchenko & Defazio, "Prodigy: An Expeditiously Adaptive Parameter-Free Learner", 2023): Adam whose
step size D is estimated from the run itself, so `train.learning_rate` is a multiplier of it (1.0 as users set it).

The arithmetic is prodigyopt 1.1.2's `Prodigy` (the package kohya's and SimpleTuner's users train with), which
`tests/train/test_optimizers.py` compares with this one step by step. It is written again here for one reason: D
comes from two sums over *every* trained weight of the model (<g, p0 - p> and |s|), and on a pipeline each process
holds only its stages' weights. prodigyopt sums across processes only for FSDP, over the whole world, on `.cuda()`
tensors: on a pipeline it would estimate D from one stage's weights (each stage its own D, unlike the unsplit
model), or, on CPU, fail. Here the two sums are all-reduced over the pipeline's processes (the replicas of a stage
hold the same weights and gradients, so not over those), a tied weight held by two processes is counted once, and
they are read on the host once a step instead of twice per weight. Its per-weight loops are torch's multi-tensor
ops here (one kernel per op for every weight; prodigyopt's loops took ~200 ms a step for an SDXL LoRA's 1,120
adapters on an H200).

Not prodigyopt's `slice_p` (D from every p-th element) nor its coupled weight decay; p0 is kept whole even where a
weight starts at zero (prodigyopt keeps a scalar there), so a checkpoint's shapes never depend on the values.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..pipeline.data_parallel import local
from ..torch_support import foreach

__all__ = ["Prodigy", "PRODIGY_STATE_KEYS", "ESTIMATE_KEYS"]

PRODIGY_STATE_KEYS = ("s", "p0", "exp_avg", "exp_avg_sq", "step")  # each trained weight's, in a checkpoint
ESTIMATE_KEYS = ("d", "d_max", "d_numerator", "k")  # the run's, one value each, the same on every process
_USE = "Prodigy's step"


class Prodigy(torch.optim.Optimizer):
    """prodigyopt 1.1.2's Prodigy (decoupled weight decay) over the weights of this process, with D estimated over
    the weights of every process of `reduce_group` (None: this process alone). `not_counted` holds the ids of
    weights another process counts (the second copy of a tied weight)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0,
                 d0: float = 1e-6, d_coef: float = 1.0, growth_rate: float = math.inf, beta3: float | None = None,
                 use_bias_correction: bool = False, safeguard_warmup: bool = False,
                 reduce_group: dist.ProcessGroup | None = None, not_counted: frozenset[int] = frozenset(),
                 chunk_elements: int = 1 << 26):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.d0, self.d_coef, self.growth_rate = d0, d_coef, growth_rate
        self.beta3 = beta3 if beta3 is not None else math.sqrt(betas[1])
        self.use_bias_correction, self.safeguard_warmup = use_bias_correction, safeguard_warmup
        self.reduce_group, self.not_counted = reduce_group, not_counted
        self.chunk_elements = chunk_elements  # a step's temporaries are this many elements' at most (`_chunks`)
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
            return torch.cat([t.double().reshape(-1) for t in terms]).sum() if terms else torch.zeros(
                (), dtype=torch.float64, device=device)

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
        held = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in held:
            if "step" not in self.state[p]:
                self.init_weight_state(p)
        weights, grads = [local(p) for p in held], [local(p.grad) for p in held]
        state = {key: [self.state[p][key] for p in held] for key in ("p0", "s", "exp_avg", "exp_avg_sq")}
        counted = [i for i, p in enumerate(held) if id(p) not in self.not_counted]
        numerator, denominator = [], []
        if lr > 0 and held:
            # <g, p0 - p> per weight, then the moments and s, each a fused kernel over every weight
            dots = []
            for chunk in _chunks(counted, weights, self.chunk_elements):
                moved = foreach("sub", _USE)([state["p0"][i] for i in chunk], [weights[i] for i in chunk])
                dots += [torch.dot(grads[i].flatten(), m.flatten()) for i, m in zip(chunk, moved)]
            numerator = [torch.stack(dots).double() * ((d / self.d0) * dlr)] if dots else []  # float64, as .item()
            if beta1 > 0:
                foreach("mul_", _USE)(state["exp_avg"], beta1)
                foreach("add_", _USE)(state["exp_avg"], grads, alpha=d * (1 - beta1))
            foreach("mul_", _USE)(state["exp_avg_sq"], beta2)
            foreach("addcmul_", _USE)(state["exp_avg_sq"], grads, grads, value=d * d * (1 - beta2))
            foreach("mul_", _USE)(state["s"], self.beta3)
            foreach("add_", _USE)(state["s"], grads, alpha=(d / self.d0) * (d if self.safeguard_warmup else dlr))
            # |s| summed per weight as prodigyopt sums it (torch's fused 1-norm reduces in another order)
            magnitudes = [s.sum() for chunk in _chunks(counted, weights, self.chunk_elements)
                          for s in foreach("abs", _USE)([state["s"][i] for i in chunk])]
            denominator = [torch.stack(magnitudes)] if magnitudes else []
        device = weights[0].device if weights else torch.device("cpu")
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
        for p in held:
            self.state[p]["step"] += 1
        position = {id(p): i for i, p in enumerate(held)}
        for group in self.param_groups:
            for mine in _chunks([position[id(q)] for q in group["params"] if id(q) in position], weights,
                                 self.chunk_elements):
                self._update([weights[i] for i in mine], [state["exp_avg"][i] for i in mine] if beta1 > 0 else None,
                             [state["exp_avg_sq"][i] for i in mine], [grads[i] for i in mine], group, d, dlr)
        e["k"] = k + 1
        return None

    def _update(self, group_weights, exp_avgs, exp_avg_sqs, grads, group: dict, d: float, dlr: float) -> None:
        """These weights' step: decoupled weight decay, then Adam's step of the first moment (or, without one, of the
        gradient) over the root of the second plus d x eps."""
        denom = foreach("sqrt", _USE)(exp_avg_sqs)
        foreach("add_", _USE)(denom, d * group["eps"])
        if group["weight_decay"]:
            foreach("add_", _USE)(group_weights, group_weights, alpha=-group["weight_decay"] * dlr)
        if exp_avgs is not None:
            foreach("addcdiv_", _USE)(group_weights, exp_avgs, denom, value=-dlr)
        else:
            foreach("addcdiv_", _USE)(group_weights, grads, denom, value=-dlr * d)


def _chunks(indices: list[int], tensors: list[torch.Tensor], elements: int) -> list[list[int]]:
    """`indices` in runs of about `elements` elements of `tensors` (64 Mi by default: 256 MiB in fp32): a step's temporaries
    (p0 - p, |s|, the denominator) are one run's, not a copy of every trained weight (a full fine-tune's)."""
    runs, size = [[]], 0
    for i in indices:
        if runs[-1] and size + tensors[i].numel() > elements:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += tensors[i].numel()
    return [run for run in runs if run]
