"""Which named tensors cross each stage boundary, and how stages are balanced."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from diffpipe.models.units import Backbone, Unit
from diffpipe.pipeline.split import SplitError, balanced_by_parameters, live_after, stage_specs


class _Writes(nn.Module):
    def __init__(self, names, size=1):
        super().__init__()
        self.names = names
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, **named):
        total = sum(named.values()) if named else torch.zeros(1)
        return {n: total * self.weight for n in self.names}


def _chain(spec, sizes=None) -> Backbone:
    """spec: [(reads, writes)] per unit; 'x' is the model input, 'cond' a condition."""
    sizes = sizes or [1] * len(spec)
    units = [Unit(f"u{i}", _Writes(list(w), s), tuple(r), tuple(w)) for i, ((r, w), s) in enumerate(zip(spec, sizes))]
    model = nn.ModuleList(u.module for u in units)
    return Backbone(units=units, inputs=("x",), conditions=("cond",), output=spec[-1][1][0], model=model)


# a small UNet-like dataflow: skip a made early and read at the end, skip b read in the middle
UNET_LIKE = [(("x",), ("a",)), (("a", "cond"), ("b",)), (("b",), ("h",)), (("h", "b"), ("h",)),
             (("h",), ("h",)), (("h", "a"), ("out",))]


def test_skip_used_inside_one_stage_never_crosses():
    specs = stage_specs(_chain(UNET_LIKE), [4])  # b is made (unit 1) and last read (unit 3) on stage 0
    assert "b" not in specs[0].sends
    assert specs[0].sends == ("a", "h")


def test_skip_read_stages_later_passes_through_every_stage_between():
    specs = stage_specs(_chain(UNET_LIKE), [1, 2, 3, 5])
    for spec in specs[:-1]:
        assert "a" in spec.sends, spec
    assert specs[-1].receives == ("a", "h") and specs[-1].sends == ("out",)


def test_conditions_never_cross_and_rewritten_names_cross_once():
    backbone = _chain(UNET_LIKE)
    for k in range(len(UNET_LIKE) - 1):
        live = live_after(backbone, k)
        assert "cond" not in live and len(set(live)) == len(live)


def test_read_without_writer_is_reported():
    with pytest.raises(SplitError, match="no earlier unit writes"):
        live_after(_chain([(("x",), ("a",)), (("zzz",), ("out",))]), 0)


def test_bad_split_names_the_units():
    with pytest.raises(SplitError, match="strictly increasing unit indices in 1..5"):
        stage_specs(_chain(UNET_LIKE), [3, 3])


def test_balanced_split_minimises_largest_stage_exactly():
    import itertools
    sizes = [5, 1, 9, 2, 2, 7, 3, 1]
    backbone = _chain([(("x",), ("h",))] + [(("h",), ("h",))] * 7, sizes)
    for stages in (2, 3, 4):
        starts = balanced_by_parameters(backbone, stages)
        bounds = [0, *starts, len(sizes)]
        got = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = min(max(sum(sizes[a:b]) for a, b in zip([0, *c, 8], [*c, 8]))
                   for c in itertools.combinations(range(1, 8), stages - 1))
        assert got == best


def test_more_stages_than_units_is_refused():
    with pytest.raises(SplitError, match="only 6 units"):
        balanced_by_parameters(_chain(UNET_LIKE), 7)
