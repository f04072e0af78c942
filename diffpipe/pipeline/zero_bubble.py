"""The guard that zero-bubble schedules need: which parameters torch's split backward would miss.

Zero-bubble schedules compute a stage's input gradients first and its weight gradients later, starting the
second pass from the autograd nodes that the first pass went through (nodes downstream of a received tensor
that requires grad: `torch.distributed.pipelining._backward.stage_backward_input`). A parameter with a path to
the stage's outputs that avoids all those nodes (conv_in alone on a later stage, or its output also sent on as
a skip) gets no gradient, or part of it, and nothing says so (docs/pipelining-facts.md, pitfall 3). The first
stage is exempt: torch runs a full backward there. `missed_parameters` finds such parameters from the forward's
autograd graph, so the runtime can refuse the split before the first optimizer step.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable

import torch

__all__ = ["missed_parameters"]


def _graph(roots: list) -> tuple[set, dict]:
    """Every node reachable from `roots` and, for each, the nodes that consume its output (towards the outputs)."""
    seen, consumers, todo = set(roots), {}, deque(roots)
    while todo:
        node = todo.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen, consumers


def _downstream(starts: Iterable, consumers: dict, stop: set | None = None) -> set:
    out, todo = set(), deque(starts)
    while todo:
        node = todo.popleft()
        if node in out or (stop is not None and node in stop):
            continue
        out.add(node)
        todo.extend(consumers.get(node, ()))
    return out


def missed_parameters(outputs: Iterable[torch.Tensor], received: Iterable[torch.Tensor],
                      parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> list[str]:
    """Names of parameters whose gradient reaches `outputs` partly or wholly outside the nodes downstream of
    `received` tensors that require grad: the part a zero-bubble schedule's weight pass leaves out."""
    roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
    nodes, consumers = _graph(roots)
    leaves = {id(getattr(n, "variable", None)): n for n in nodes if hasattr(n, "variable")}
    starts = [t.grad_fn or leaves.get(id(t)) for t in received if t.requires_grad]
    reached = _downstream([n for n in starts if n is not None], consumers)
    root_set = set(roots)
    missed = []
    for name, p in parameters:
        node = leaves.get(id(p))
        if node is None:  # not used by these outputs: a full backward leaves it without gradient too
            continue
        if _downstream([node], consumers, stop=reached) & root_set:
            missed.append(name)
    return missed
