"""A process gives weights only to the units of its own stages, and they are those the whole model would have."""
from __future__ import annotations

import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import save_file

from diffpipe.build import build_backbone, give_weights
from diffpipe.config_files import build_config
from diffpipe.models.families.unet.presets import UNET_PRESETS


def _owned(backbone, units):
    return {n: p for i in units for n, p in backbone.units[i].module.named_parameters()}


def _check_partial_equals_whole(config):
    whole = build_backbone(config)
    assert not any(p.is_meta for p in whole.model.parameters())
    for units in ([0, 1, 2], [len(whole.units) - 2, len(whole.units) - 1], [5, 9]):
        part = build_backbone(config, "meta")
        give_weights(part, config, units)
        mine, theirs = _owned(part, units), _owned(whole, units)
        assert mine.keys() == theirs.keys() and mine
        for name, p in mine.items():
            assert not p.is_meta and torch.equal(p, theirs[name]), name
        # the other units hold no memory, and the stage modules find every weight under its diffusers name
        kept = {id(p) for p in mine.values()}
        others = [p for p in part.model.parameters() if id(p) not in kept]
        assert others and all(p.is_meta for p in others)
        assert all(id(p) in part.parameter_names for p in part.model.parameters())


def test_random_weights_of_a_unit_do_not_depend_on_what_else_is_built():
    config = build_config({"model": {"preset": "digits"}, "train": {"seed": 4}})
    _check_partial_equals_whole(config)
    state = torch.random.get_rng_state()
    other_seed = build_backbone(build_config({"model": {"preset": "digits"}, "train": {"seed": 5}}))
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random numbers are left alone
    first = next(build_backbone(config).model.parameters())
    assert not torch.equal(first, next(other_seed.model.parameters()))


def test_checkpoint_weights_are_read_for_own_units_only(tmp_path):
    torch.manual_seed(123)
    trained = UNet2DConditionModel(**UNET_PRESETS["digits"])
    save_file(trained.state_dict(), str(tmp_path / "digits.safetensors"))
    config = build_config({"model": {"preset": "digits", "path": str(tmp_path / "digits.safetensors")}})
    _check_partial_equals_whole(config)
    whole = build_backbone(config).model.state_dict()
    assert all(torch.equal(whole[k], v) for k, v in trained.state_dict().items())
