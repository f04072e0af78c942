"""Adapters through peft (LoRA, DoRA, LoHa, LoKr): the merged weights compute what the adapted model computes (linear
and convolution adapters), the adapted model starts as the base, the base weights stay those of the file, and a first
stage without adapters is refused before launch."""
from __future__ import annotations

import pytest
import torch
from diffusers import UNet2DConditionModel

from diffpipe.build import build_backbone, example_inputs, give_weights
from diffpipe.config_files import build_config
from diffpipe.models.lora import add_lora, is_adapter, lora_scale, merge_lora
from diffpipe.models.families.unet.presets import UNET_PRESETS
from diffpipe.models.families.unet.unet2d import UNet2DFamily
from diffpipe.pipeline.split import SplitError
from diffpipe.preflight import check_before_launch

TARGETS = ["to_q", "to_v", "conv1", "conv_in", "proj_in"]
KINDS = ["lora", "dora", "loha", "lokr"]


def _inputs():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(2, 1, 8, 8, generator=generator), torch.tensor([10.0, 900.0]),
            torch.randn(2, 8, 32, generator=generator))


@pytest.mark.parametrize("kind", KINDS)
def test_merged_weights_compute_what_the_adapted_model_computes(kind):
    config = build_config({"adapter": {"type": kind, "rank": 4, "alpha": 12.0, "target_modules": TARGETS}})
    torch.manual_seed(0)
    adapted = UNet2DConditionModel(**UNET_PRESETS["digits"])
    add_lora(adapted, config.adapter, UNet2DFamily.lora_targets, seed=0)
    with torch.no_grad():  # one factor of each starts at zero: give every adapter a value (DoRA: its magnitude too)
        for name, p in adapted.named_parameters():
            if is_adapter(name):
                p.add_(torch.randn_like(p) * (0.05 * p.abs().mean() if ".lora_magnitude_vector." in name else 0.05))
    merged = merge_lora(adapted.state_dict(), lora_scale(config.adapter))
    plain = UNet2DConditionModel(**UNET_PRESETS["digits"])
    plain.load_state_dict(merged)
    x, t, text = _inputs()
    with torch.no_grad():
        want = adapted.eval()(x, t, encoder_hidden_states=text).sample
        got = plain.eval()(x, t, encoder_hidden_states=text).sample
        torch.manual_seed(0)
        base = UNet2DConditionModel(**UNET_PRESETS["digits"]).eval()(x, t, encoder_hidden_states=text).sample
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - base).abs().max() > 1e-3  # the adapters change the output: the comparison sees the merge
    assert any(".conv1." in n and is_adapter(n) for n, _ in adapted.named_parameters())  # convolutions adapted too


@pytest.mark.parametrize("kind", KINDS)
def test_only_adapters_train_and_the_adapted_model_starts_as_the_base(kind):
    lora = build_config({"adapter": {"type": kind, "rank": 4}})
    backbone = build_backbone(lora, "meta")  # as a run builds it: adapters on the meta device, weights given after
    give_weights(backbone, lora)
    trainable = [n for n, p in backbone.model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter(n) for n in trainable)
    full = build_backbone(build_config({}))
    base = {k.replace(".base_layer.", "."): v for k, v in backbone.model.state_dict().items() if not is_adapter(k)}
    assert base.keys() == full.model.state_dict().keys()
    assert all(torch.equal(base[k], v) for k, v in full.model.state_dict().items())
    x, t, text = _inputs()
    with torch.no_grad():
        got = backbone.model.eval()(x, t, encoder_hidden_states=text).sample
        want = full.model.eval()(x, t, encoder_hidden_states=text).sample
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_first_stage_without_adapters_is_refused_before_launch():
    config = build_config({"adapter": {"type": "lora"}, "pipeline": {"split": [2]}})
    with pytest.raises(SplitError, match="stage 0 .* holds no trainable parameter"):
        check_before_launch(config)
    check_before_launch(build_config({"adapter": {"type": "lora"}, "pipeline": {"split": [4]}}))  # down.0 adapts


@pytest.mark.parametrize("prefix", ["unet.", "transformer.", ""])  # diffusers' files: the component's name first
def test_adapters_start_from_a_lora_file_when_asked(tmp_path, prefix):
    from safetensors.torch import save_file

    from diffpipe.config import ConfigError
    from diffpipe.models.lora import lora_weights

    config = build_config({"adapter": {"type": "lora", "rank": 4}, "train": {"seed": 1}})
    source = build_backbone(config, "meta")
    give_weights(source, config)
    with torch.no_grad():
        for name, p in source.model.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    saved = {f"{prefix}{k}": v for k, v in lora_weights(source.model.state_dict()).items()}
    save_file(saved, str(tmp_path / "lora.safetensors"))
    resumed = build_config({"adapter": {"type": "lora", "rank": 4, "init_from": str(tmp_path / "lora.safetensors")}})
    target = build_backbone(resumed, "meta")
    give_weights(target, resumed)
    for (name, want), (_, got) in zip(source.model.named_parameters(), target.model.named_parameters()):
        if ".lora_" in name:
            assert torch.equal(got, want), name
    wrong_rank = build_config({"adapter": {"type": "lora", "rank": 8, "init_from": str(tmp_path / "lora.safetensors")}})
    with pytest.raises(ConfigError, match="set adapter.rank to the file's"):
        give_weights(build_backbone(wrong_rank, "meta"), wrong_rank)


def test_every_targeted_module_trains_its_adapter_through_the_units():
    """peft replaces a targeted module in its parent; a unit that holds the module itself (the UNet's conv_in and
    conv_out) must hold the adapted one, or its adapter silently never trains nor reaches the export."""
    targets = ["to_q", "conv_in", "conv_out", "linear_1"]
    config = build_config({"adapter": {"type": "lora", "rank": 4, "target_modules": targets}})
    backbone = build_backbone(config, "meta")
    give_weights(backbone, config)
    for name, p in backbone.model.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(p)  # B starts at zero, which would leave A without a gradient
    inputs, conditions = example_inputs(config, backbone, 2)
    generator = torch.Generator().manual_seed(0)
    named = {k: torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
             for k, v in {**inputs, **conditions}.items()}  # zeros would leave some adapters without a gradient
    for unit in backbone.units:
        named.update(unit({k: named[k] for k in unit.reads}))
    named["prediction"].square().mean().backward()
    adapters = {n: p for n, p in backbone.model.named_parameters() if p.requires_grad}
    assert {n.split(".lora_")[0] for n in adapters} >= {"conv_in", "conv_out", "time_embedding.linear_1"}
    missed = [n for n, p in adapters.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missed == []
