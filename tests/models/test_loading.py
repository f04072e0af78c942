"""Loading real checkpoints from files the test writes: diffusers folders and single .safetensors files."""
from __future__ import annotations

import json

import pytest
import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import save_file

from diffpipe.build import build_backbone
from diffpipe.preflight import check_before_launch
from diffpipe.config import ModelConfig
from diffpipe.config_files import build_config
from diffpipe.models.loading import CheckpointError, build_model
from diffpipe.models.families.unet.unet2d import UNet2DFamily
from diffpipe.models.families.unet.presets import UNET_PRESETS


def _trained_like_unet() -> UNet2DConditionModel:
    torch.manual_seed(123)
    return UNet2DConditionModel(**UNET_PRESETS["digits"])


def _built(model: dict) -> UNet2DConditionModel:
    return build_backbone(build_config({"model": model})).model


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_loads_a_diffusers_folder(tmp_path):
    unet = _trained_like_unet()
    unet.save_pretrained(tmp_path / "unet")  # as in a pipeline folder: <root>/unet/config.json
    loaded = _built({"path": str(tmp_path), "preset": None})
    _assert_same_weights(unet, loaded)


def test_loads_a_single_safetensors_file_with_a_given_architecture(tmp_path):
    unet = _trained_like_unet()
    save_file(unet.state_dict(), str(tmp_path / "digits.safetensors"))
    loaded = _built({"path": str(tmp_path / "digits.safetensors"), "preset": "digits"})
    _assert_same_weights(unet, loaded)


def test_loads_a_diffpipe_run_folder(tmp_path):
    unet = _trained_like_unet()
    save_file(unet.state_dict(), str(tmp_path / "model.safetensors"))
    (tmp_path / "model_config.json").write_text(json.dumps(dict(unet.config)))
    _assert_same_weights(unet, _built({"path": str(tmp_path)}))


def test_checkpoint_of_another_model_is_refused_before_launch(tmp_path):
    other = UNet2DConditionModel(**dict(UNET_PRESETS["digits"], block_out_channels=(16, 32)))
    save_file(other.state_dict(), str(tmp_path / "other.safetensors"))
    config = build_config({"model": {"path": str(tmp_path / "other.safetensors")}})
    with pytest.raises(CheckpointError, match="does not match this model's architecture: .* of another shape"):
        check_before_launch(config)


def test_corrupt_checkpoint_is_refused_with_the_file_named(tmp_path):
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"\x00" * 64)
    config = build_config({"model": {"path": str(bad)}})
    with pytest.raises(CheckpointError, match="broken.safetensors is not a readable .safetensors file"):
        check_before_launch(config)


def test_single_file_without_architecture_asks_for_one(tmp_path):
    save_file(_trained_like_unet().state_dict(), str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError, match="give the architecture too"):
        build_model(ModelConfig(path=str(tmp_path / "w.safetensors"), preset=None), UNet2DFamily())


def test_weights_whose_data_bytes_are_damaged_are_never_trained_on(tmp_path):
    """Header intact, data overwritten with 0xFF (NaN in float32): refused by name when the weights are read."""
    path = tmp_path / "w.safetensors"
    save_file(_trained_like_unet().state_dict(), str(path))
    raw = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    raw[header:header + 4096] = b"\xff" * 4096  # the first tensors' data
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="holds NaN or inf values"):
        _built({"path": str(path), "preset": "digits"})


@pytest.mark.parametrize("suffix", [".ckpt", ".bin", ".pt"])
def test_pickle_weights_are_refused_unread(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"\x80\x04 not to be unpickled")
    config = build_config({"model": {"path": str(path)}})
    with pytest.raises(CheckpointError, match="pickles"):
        check_before_launch(config)


def _original_layout_file(tmp_path, unet: UNet2DConditionModel):
    """A single file as A1111 / ComfyUI share them: the UNet under model.diffusion_model.*, beside a VAE's and a
    text encoder's tensors (which the UNet's loading leaves alone)."""
    from diffpipe.models.single_file import to_original_layout

    tensors = to_original_layout(unet.state_dict(), dict(unet.config))
    tensors["first_stage_model.decoder.conv_in.weight"] = torch.zeros(4, 4, 3, 3)
    tensors["conditioner.embedders.0.transformer.text_model.embeddings.position_ids"] = torch.zeros(1, 77)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "finetune.safetensors"))
    return tmp_path / "finetune.safetensors"


@pytest.mark.parametrize("style", ["sd", "sdxl"])
def test_loads_an_original_layout_single_file_through_diffusers_conversion(tmp_path, monkeypatch, style):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = dict(UNET_PRESETS["digits"])
    if style == "sdxl":
        config.update(addition_embed_type="text_time", addition_time_embed_dim=8,
                      projection_class_embeddings_input_dim=16 + 6 * 8, transformer_layers_per_block=(1, 2),
                      use_linear_projection=True)  # diffusers converts int layers_per_block only, as SD and SDXL have
    torch.manual_seed(5)
    unet = UNet2DConditionModel(**config)
    path = _original_layout_file(tmp_path, unet)
    model = {"path": str(path), "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}}
    _assert_same_weights(unet, _built(model))
    converted = list((tmp_path / "cache" / "diffpipe" / "converted").glob("finetune-*.safetensors"))
    assert len(converted) == 1  # converted once; a second build reads the converted file
    _assert_same_weights(unet, _built(model))
    assert list((tmp_path / "cache" / "diffpipe" / "converted").glob("finetune-*.safetensors")) == converted


def test_an_original_layout_file_of_another_architecture_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    torch.manual_seed(5)
    path = _original_layout_file(tmp_path, UNet2DConditionModel(**UNET_PRESETS["digits"]))
    wider = dict(UNET_PRESETS["digits"], block_out_channels=[32, 96])
    with pytest.raises(CheckpointError, match="does not match this model's architecture|does not convert"):
        _built({"path": str(path), "config": {k: list(v) if isinstance(v, tuple) else v for k, v in wider.items()}})


def test_a_text_encoder_folder_of_pickles_is_refused_unread(tmp_path):
    """transformers would unpickle a `pytorch_model.bin` it finds (model.text_encoder pointing at such a folder)."""
    from diffpipe.models.text import TextEncoder

    folder = tmp_path / "clip"
    TextEncoder.tiny(hidden_size=32, projection_dim=32, max_length=8, seed=0).save(folder)
    TextEncoder.from_folder(folder, 8)  # the safetensors folder loads
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")  # its bytes are never read
    with pytest.raises(CheckpointError, match=r"only pickle weight files \(pytorch_model.bin\)"):
        TextEncoder.from_folder(folder, 8)


def test_a_single_file_converted_for_one_architecture_is_not_reused_for_another(tmp_path, monkeypatch):
    """The conversion cache was keyed by the file alone: a first conversion under a wrong config was used forever."""
    from diffpipe.models.single_file import converted_file
    from diffpipe.models.families.unet.unet2d import UNet2DFamily

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = dict(UNET_PRESETS["digits"])
    torch.manual_seed(5)
    unet = UNet2DConditionModel(**config)
    path = _original_layout_file(tmp_path, unet)
    first = converted_file(path, UNet2DFamily(), dict(unet.config))
    other = converted_file(path, UNet2DFamily(), dict(unet.config, upcast_attention=not unet.config.upcast_attention))
    assert first != other and first.is_file() and other.is_file()
    assert converted_file(path, UNet2DFamily(), dict(unet.config)) == first  # the same file and architecture: reused
