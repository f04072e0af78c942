"""The UNet adapter's units, run in order (and as stages), compute exactly diffusers' forward."""
from __future__ import annotations

import pytest
import torch
from diffusers import UNet2DConditionModel

from diffpipe.models.families.unet.unet2d import unet_backbone
from diffpipe.pipeline.split import stage_specs
from diffpipe.pipeline.stage import build_stage_modules
from diffpipe.sampling import run_stages

SD_STYLE = dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 64, 64),
                down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                cross_attention_dim=24, attention_head_dim=8, norm_num_groups=8)
SDXL_STYLE = dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 64, 64),
                  down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                  mid_block_type="UNetMidBlock2DCrossAttn", transformer_layers_per_block=(1, 1, 2),
                  cross_attention_dim=24, attention_head_dim=(2, 4, 4), norm_num_groups=8, use_linear_projection=True,
                  addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=16 + 6 * 8,
                  flip_sin_to_cos=True, freq_shift=0)


def _inputs(config: dict, batch: int = 3, size: tuple[int, int] = (16, 16)):
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(batch, 4, *size, generator=gen)
    conditions = {"timestep": torch.tensor([0.0, 417.0, 999.0][:batch]),
                  "encoder_hidden_states": torch.randn(batch, 7, 24, generator=gen)}
    if config.get("addition_embed_type") == "text_time":
        conditions["text_embeds"] = torch.randn(batch, 16, generator=gen)
        conditions["time_ids"] = torch.tensor([[16.0, 16, 0, 0, 16, 16]]).expand(batch, 6)
    return sample, conditions


def _diffusers_forward(unet, sample, conditions):
    added = {k: conditions[k] for k in ("text_embeds", "time_ids") if k in conditions} or None
    return unet(sample, conditions["timestep"], conditions["encoder_hidden_states"], added_cond_kwargs=added).sample


NO_MID = dict(SD_STYLE, mid_block_type=None)


@pytest.mark.parametrize("granularity", ["blocks", "layers"])
@pytest.mark.parametrize("config", [SD_STYLE, SDXL_STYLE, NO_MID], ids=["sd-style", "sdxl-style", "no-mid-block"])
def test_units_in_order_equal_diffusers_forward(config, granularity):
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**config).eval()
    backbone = unet_backbone(unet, granularity)
    sample, conditions = _inputs(config)
    with torch.no_grad():
        expected = _diffusers_forward(unet, sample, conditions)
        got = backbone.forward({"sample": sample}, conditions)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("config", [SD_STYLE, SDXL_STYLE], ids=["sd-style", "sdxl-style"])
def test_layer_units_cut_inside_blocks(config):
    unet = UNet2DConditionModel(**config)
    names = [u.name for u in unet_backbone(unet, "layers").units]
    assert "up.0.0" in names and "down.0.0" in names and "mid.1" in names
    assert len(names) > len(unet_backbone(unet, "blocks").units)


@pytest.mark.parametrize("config", [SD_STYLE, SDXL_STYLE], ids=["sd-style", "sdxl-style"])
def test_every_split_into_stages_equals_diffusers_forward(config):
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**config).eval()
    backbone = unet_backbone(unet)
    sample, conditions = _inputs(config)
    with torch.no_grad():
        expected = _diffusers_forward(unet, sample, conditions)
        for starts in ([], [1], [3, 7], list(range(1, len(backbone.units)))):
            modules = build_stage_modules(backbone, stage_specs(backbone, starts))
            assert torch.equal(run_stages(modules, sample, conditions), expected), starts


@pytest.mark.parametrize("granularity", ["blocks", "layers"])
@pytest.mark.parametrize("size", [(13, 11), (9, 16)])
def test_odd_latent_sizes_equal_diffusers_forward(size, granularity):
    """Sizes the UNet does not divide: the upsamplers return to each skip's size, as diffusers' forward does."""
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**SDXL_STYLE).eval()
    backbone = unet_backbone(unet, granularity)
    sample, conditions = _inputs(SDXL_STYLE, size=size)
    with torch.no_grad():
        expected = _diffusers_forward(unet, sample, conditions)
        assert expected.shape[-2:] == size
        for starts in ([], [3, 7], list(range(1, len(backbone.units)))):
            modules = build_stage_modules(backbone, stage_specs(backbone, starts))
            assert torch.equal(run_stages(modules, sample, conditions), expected), starts


@pytest.mark.parametrize("granularity", ["blocks", "layers"])
@pytest.mark.parametrize("config", [SD_STYLE, SDXL_STYLE], ids=["sd-style", "sdxl-style"])
def test_units_in_train_mode_give_diffusers_gradients(config, granularity):
    """Forward and backward in train mode: every parameter's gradient equals that through diffusers' forward."""
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**config).train()
    backbone = unet_backbone(unet, granularity)
    sample, conditions = _inputs(config)
    weight = torch.randn(sample.shape, generator=torch.Generator().manual_seed(1))
    (_diffusers_forward(unet, sample, conditions) * weight).sum().backward()
    expected = {n: p.grad.clone() for n, p in unet.named_parameters()}
    unet.zero_grad(set_to_none=True)
    (backbone.forward({"sample": sample}, conditions) * weight).sum().backward()
    got = {n: p.grad for n, p in unet.named_parameters()}
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert got[name] is not None and torch.equal(got[name], grad), name


def test_stage_weights_keep_diffusers_names():
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**SDXL_STYLE)
    backbone = unet_backbone(unet)
    modules = build_stage_modules(backbone, stage_specs(backbone, [2, 5]))
    merged = {k: v for m in modules for k, v in m.full_state_dict().items()}
    assert merged.keys() == unet.state_dict().keys()
    assert all(torch.equal(merged[k], v) for k, v in unet.state_dict().items())


def test_unsupported_unet_option_is_refused_by_name():
    unet = UNet2DConditionModel(**dict(SD_STYLE, class_embed_type="timestep"))
    with pytest.raises(ValueError, match="class_embed_type"):
        unet_backbone(unet)
