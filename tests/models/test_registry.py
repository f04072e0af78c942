"""Model families by model.architecture: the built-in ones, one defined outside diffpipe (tests/models/toy_family.py,
named by import path), and the errors a wrong name gets."""
from __future__ import annotations

import pytest

from diffpipe.build import build_backbone, example_inputs, sample_shape
from diffpipe.config import ConfigError
from diffpipe.config_files import build_config
from diffpipe.pipeline.split import stage_specs
from diffpipe.pipeline.tied import tied_parameters
from diffpipe.preflight import check_before_launch

TOY = "tests.models.toy_family:ToyFamily"


def test_a_family_outside_diffpipe_builds_plans_and_trains_its_first_stage():
    config = build_config({"model": {"architecture": TOY}, "pipeline": {"stages": 2, "split": "auto"}})
    checked = check_before_launch(config)  # plans the split on the meta device
    assert [u.name for u in checked.backbone.units][:2] == ["in", "block.0"] and len(checked.split) == 1
    backbone = build_backbone(config)  # seeded random weights through each module's reset_parameters
    inputs, conditions = example_inputs(config, backbone, 2)
    assert sample_shape(config, backbone) == (1, 8, 8)
    out = backbone.forward(inputs, conditions)
    assert out.shape == (2, 64, 1)  # its prediction layout: pixels as tokens


def test_a_weight_used_by_the_first_and_last_units_is_found_tied():
    config = build_config({"model": {"architecture": TOY}})
    backbone = build_backbone(config, "meta")
    last = len(backbone.units) - 1
    tied = tied_parameters(backbone, stage_specs(backbone, [2, last]))
    assert [(t.name, t.stages) for t in tied] == [("shared_norm.bias", (0, 2)), ("shared_norm.weight", (0, 2))]
    assert tied_parameters(backbone, stage_specs(backbone, [])) == []  # one stage: nothing to share


@pytest.mark.parametrize("architecture,says", [
    ("dit", "model.architecture: 'dit' is not one of unet2d, flux, flux_kontext, chroma, sd3, wan, wan_i2v, unet3d, "
            "qwen_image, qwen_image_edit, hunyuan_video15, z_image, flux2, ltx2, or a ModelFamily subclass"),
    ("tests.models.nowhere:Family", "cannot import"),
    ("diffpipe.config:RunConfig", "is not a ModelFamily subclass"),
])
def test_a_wrong_architecture_is_refused_naming_the_choices(architecture, says):
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        build_backbone(build_config({"model": {"architecture": architecture}}), "meta")


@pytest.mark.parametrize("architecture,preset,billions", [("flux", "dev", 11.9), ("sd3", "medium", 2.0),
                                                          ("sd3", "large35", 8.1), ("wan", "t2v-1.3b", 1.4),
                                                          ("wan", "t2v-14b", 14.3), ("chroma", "hd", 8.9),
                                                          ("wan_i2v", "i2v-a14b", 14.3), ("wan", "ti2v-5b", 5.0),
                                                          ("wan_i2v", "ti2v-5b", 5.0), ("wan_i2v", "i2v-14b", 16.4),
                                                          ("hunyuan_video15", "480p-t2v", 8.3)])
def test_the_real_width_presets_build_on_the_meta_device(architecture, preset, billions):
    config = build_config({"model": {"architecture": architecture, "preset": preset}, "data": {"dataset": "synthetic"}})
    backbone = build_backbone(config, "meta")
    assert round(sum(p.numel() for p in backbone.model.parameters()) / 1e9, 1) == billions


def test_a_preset_of_another_family_is_refused():
    with pytest.raises(Exception, match="not a flux preset; choose one of"):
        build_backbone(build_config({"model": {"architecture": "flux", "preset": "sdxl"}}), "meta")
