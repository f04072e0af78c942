"""Both experts of a two-expert pipeline in one run (Wan 2.2 A14B: `model.expert = "both"`): each sample goes to the
expert that serves its timestep, as WanPipeline picks `transformer` for t >= boundary_ratio x 1000 and
`transformer_2` below.

`TwoExperts` holds both models (`transformer`, `transformer_2`: the weights are named as the pipeline folder names its
subfolders) and its forward is the pipeline's choice made per sample, so a family's `diffusers_forward` on it is the
reference the units are tested against. The backbone's units pair the experts' units of the same name: a unit runs
each expert's on the samples routed to it (`timestep`, a condition every stage is given, decides), so both experts'
unit i live on the same stage and every stage works whichever expert a micro-batch needs. A micro-batch of one
expert's samples (always so with one sample a micro-batch) runs that expert's unit alone; a mixed one runs each on
its rows and puts the rows back in order.

Why the same stages hold both experts, and not one expert a group of GPUs: a step's samples fall on either side at
random (above Wan 2.2 T2V's boundary of 0.875: 1 in 8 under a uniform draw, about 2 in 5 under a shift of 5), so a
GPU holding one expert only would wait whenever its expert drew few samples. Memory is both
experts' weights per stage (2 x 14.3 B for A14B), which the planner counts (a unit's parameters are both experts')
and the memory levers (bf16 or fp8 bases, block swap, more stages) bring under the cards' limit.

Gradients as a plain loop holding both experts makes them: an expert no sample of the step reached has none, and
AdamW leaves it be. With data-parallel replicas, a replica whose samples all go to one expert must still make a
gradient for the other's weights (torch's DDP waits for every one; FSDP2 reduces a unit's together): a unit ties its
idle expert's trained weights to its output times zero, so each replica gives zeros there and the average over the
replicas is the batch's. `IdleExpertGradients` then drops, after the backward, the gradients of an expert that no
sample of the step's global batch reached (the step's timesteps are known on the host), so AdamW's moments do not
move it on zeros.
"""
from __future__ import annotations

import torch
from torch import nn

from .units import Backbone, Unit

__all__ = ["TwoExperts", "two_expert_backbone", "each_expert", "EXPERT_COMPONENTS", "IdleExpertGradients",
           "WAN22_T2V_BOUNDARY"]

EXPERT_COMPONENTS = ("transformer", "transformer_2")  # high noise, low noise: the pipeline folder's subfolders
WAN22_T2V_BOUNDARY = 0.875  # Wan2.2-T2V-A14B-Diffusers' boundary_ratio: two of a preset (no folder) switch here


def _rows(value, rows: torch.Tensor):
    """A per-sample tensor's rows of the samples `rows` marks (anything else as it is)."""
    return value[rows] if torch.is_tensor(value) and value.dim() > 0 else value


class TwoExperts(nn.Module):
    """A high-noise and a low-noise model of one architecture, switched per sample at `boundary` (a model
    timestep: boundary_ratio x 1000)."""

    def __init__(self, high: nn.Module, low: nn.Module, boundary: float):
        super().__init__()
        self.transformer, self.transformer_2 = high, low
        self.boundary = boundary

    @property
    def config(self):
        return self.transformer.config

    def high_rows(self, timestep: torch.Tensor) -> torch.Tensor:
        """Per sample: whether the high-noise expert serves it. A timestep per token (TI2V's) goes by its largest."""
        per_sample = timestep if timestep.dim() == 1 else timestep.flatten(1).amax(dim=1)
        return per_sample >= self.boundary

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, return_dict: bool = False, **kwargs):
        """The experts' own forwards, each on its samples (WanPipeline's choice per sample): `return_dict=False`'s
        tuple of the prediction."""
        high = self.high_rows(timestep)
        out = None
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            if not rows.any():
                continue
            part = expert(hidden_states=hidden_states[rows], timestep=timestep[rows], return_dict=False,
                          **{k: _rows(v, rows) for k, v in kwargs.items()})[0]
            if out is None:
                out = part.new_empty(hidden_states.shape[0], *part.shape[1:])
            out[rows] = part
        return (out,)


def each_expert(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name prefix, model) of each expert a backbone's model holds: both of a TwoExperts under their subfolders'
    names, else the model itself with no prefix. What a family says of one model (the modules it never trains, the
    buffers its constructor fills) is said of each."""
    if isinstance(model, TwoExperts):
        return [(f"{name}.", getattr(model, name)) for name in EXPERT_COMPONENTS]
    return [("", model)]


class _RoutedUnit(nn.Module):
    """Two experts' units of one name: each on the rows `timestep` routes to it."""

    def __init__(self, high: Unit, low: Unit, experts: TwoExperts, tables: tuple[str, ...]):
        super().__init__()
        self.high, self.low = high.module, low.module
        self.name, self.reads, self.tables = high.name, high.reads, tables
        self.route = experts.high_rows  # (a bound method: the boundary, no module registered twice)

    def _rows(self, named: dict, rows: torch.Tensor) -> dict:
        picked = {}
        for name, value in named.items():
            if name in self.tables or not torch.is_tensor(value) or value.dim() == 0:
                picked[name] = value
            elif value.shape[0] != rows.shape[0]:
                raise RuntimeError(f"unit {self.name}: {name} has {value.shape[0]} rows for {rows.shape[0]} samples; "
                                   "a table for the whole batch belongs in the backbone's `tables`")
            else:
                picked[name] = value[rows]
        return picked

    def forward(self, **named):
        own = {name: named[name] for name in self.reads}
        if named["timestep"].is_meta:  # traced for shapes and costs (the planner): either expert's are a sample's
            return self.high(**own)
        rows = self.route(named["timestep"])
        if bool(rows.all()):
            return _tied(self.high(**own), self.low, self.tables)
        if not bool(rows.any()):
            return _tied(self.low(**own), self.high, self.tables)
        high, low = self.high(**self._rows(own, rows)), self.low(**self._rows(own, ~rows))
        joined = {}
        for name, written in high.items():
            if name in self.tables:  # the same for both experts (one config): either's
                joined[name] = written
                continue
            out = written.new_empty(rows.shape[0], *written.shape[1:])
            out[rows], out[~rows] = written, low[name]
            joined[name] = out
        return joined


def _tied(written: dict[str, torch.Tensor], idle: nn.Module, tables: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """`written` with the idle expert's trained weights added to a per-sample output times zero: each gets a gradient
    of zeros (the module's docstring: what data-parallel replicas need)."""
    trained = [p for p in idle.parameters() if p.requires_grad]
    if not trained or not torch.is_grad_enabled():
        return written
    name = next(n for n in written if n not in tables)
    zero = torch.stack([p.sum() for p in trained]).sum() * 0
    return {**written, name: written[name] + zero.to(written[name].dtype)}


class IdleExpertGradients:
    """Drops, after a step's backward, the gradients of an expert that no sample of the step's global batch reached
    (`experts.high_rows` routes them, as the units do), as a plain loop leaves it none. `named`: this process's
    weights by their names (`transformer.` and `transformer_2.` first)."""

    def __init__(self, experts: TwoExperts, named):
        self.route = experts.high_rows
        self.params = {component: [p for name, p in named if name.startswith(f"{component}.")]
                       for component in EXPERT_COMPONENTS}

    def drop(self, step_timesteps: torch.Tensor) -> None:
        high = self.route(step_timesteps)
        for component, reached in zip(EXPERT_COMPONENTS, (bool(high.any()), not bool(high.all()))):
            if not reached:
                for p in self.params[component]:
                    p.grad = None


def two_expert_backbone(family, model: TwoExperts, granularity: str) -> Backbone:
    """Each expert described by `family`, their units paired by name, each pair reading `timestep` too."""
    high, low = family.describe(model.transformer, granularity), family.describe(model.transformer_2, granularity)
    if [u.name for u in high.units] != [u.name for u in low.units]:
        raise ValueError("the two experts are described by different units: they must be one architecture")
    units = [Unit(h.name, _RoutedUnit(h, l, model, high.tables), h.reads + (("timestep",) if "timestep" not in h.reads else ()),
                  h.writes) for h, l in zip(high.units, low.units)]
    return Backbone(units=units, inputs=high.inputs, conditions=high.conditions, output=high.output, model=model,
                    tables=high.tables)
