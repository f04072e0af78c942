"""train.fp8_compute on a full fine-tune (models/fp8_training.py, torchao's float8 training): the trained linear
layers whose sides are multiples of 16 are swapped for torchao's Float8Linear with the same parameters, and their
output, input gradient and weight gradient are fp8 products (within fp8's rounding of fp32's, not bf16's); the tiny
Flux full fine-tune trains with it on 1 and 2 stages to the same losses, near the bf16 run's, and its weights load
into diffusers' model by their usual names."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from diffpipe.config import ConfigError
from diffpipe.config_files import load_config
from diffpipe.models.fp8_training import fp8_training_words, train_in_fp8
from diffpipe.torch_support import fp8_matmul_problem

from ..helpers import losses_of, run_command

FLUX = Path(__file__).parent.parent.parent / "examples" / "flux_tiny.toml"
CPU_FP8 = pytest.mark.skipif(fp8_matmul_problem(torch.device("cpu")) is not None,
                             reason="this torch's CPU kernel takes one scale per tensor (torch 2.13 has rowwise)")


def test_only_trained_linear_layers_with_sides_of_16_are_swapped_keeping_their_parameters():
    model = nn.Sequential(nn.Linear(48, 32), nn.GELU(), nn.Linear(32, 30), nn.Linear(30, 32), nn.Linear(32, 32))
    model[4].requires_grad_(False)  # frozen: a full fine-tune's fp8 compute is for what it trains
    before = [id(p) for p in model.parameters()]
    assert train_in_fp8(model, "cpu") == 1
    assert [type(m) for m in model] == [Float8Linear, nn.GELU, nn.Linear, nn.Linear, nn.Linear]
    assert [id(p) for p in model.parameters()] == before
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias",
                                        "4.weight", "4.bias"]


def test_on_a_gpu_only_layers_wide_enough_for_fp8_to_pay_are_swapped():
    """torchao's thresholds for rowwise scales (its H100 measurements): SDXL's 1280-wide attention projections and
    feed-forward output stay bf16, its feed-forward input projection (1280 -> 10240) trains in fp8, and so do Flux's
    3072-wide layers (an H100's SDXL full fine-tune with every layer in fp8 ran at 0.71x torch.compile(unet)). On a
    CPU every layer the kernels take is swapped: there fp8 is for checking the arithmetic."""
    def layers():
        with torch.device("meta"):
            return nn.ModuleDict({"sdxl_attention": nn.Linear(1280, 1280), "sdxl_ff_in": nn.Linear(1280, 10240),
                                  "sdxl_ff_out": nn.Linear(5120, 1280), "flux_attention": nn.Linear(3072, 3072),
                                  "flux_ff_out": nn.Linear(12288, 3072), "narrow_both": nn.Linear(1536, 3072)})

    gpu, cpu = layers(), layers()
    assert train_in_fp8(gpu, "cuda") == 3
    assert [name for name, m in gpu.items() if isinstance(m, Float8Linear)] == ["sdxl_ff_in", "flux_attention",
                                                                                 "flux_ff_out"]
    assert train_in_fp8(cpu, "cpu") == 6
    assert fp8_training_words(layers(), "cuda").startswith("train.fp8_compute: 3 of 6 trained linear layers")
    assert "too narrow" in fp8_training_words(layers(), "cuda")


@CPU_FP8
def test_the_swapped_layers_products_are_fp8_not_bf16():
    """Gaussian operands: the output, input gradient and weight gradient of a swapped layer are within fp8's
    rounding of the fp32 products (e4m3: 3 mantissa bits) and are not bf16's products (a silent fallback)."""
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(256, 128, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(128, 256, generator=g))
    x, grad = torch.randn(64, 256, generator=g), torch.randn(64, 128, generator=g)

    def run(module, dtype=torch.bfloat16):
        xi = x.clone().requires_grad_()
        module.weight.grad = None
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            y = module(xi)
        y.backward(grad.to(y.dtype))
        return y.float(), xi.grad.float(), module.weight.grad.float()

    exact = run(layer, None)
    bf16 = run(layer)
    train_in_fp8(layer := nn.Sequential(layer), "cpu")
    fp8 = run(layer[0])
    for name, e, b, f in zip(("output", "input gradient", "weight gradient"), exact, bf16, fp8):
        error = ((f - e).norm() / e.norm()).item()
        assert 0.01 < error < 0.08, (name, error)  # fp8's rounding of both operands
        assert ((b - e).norm() / e.norm()).item() < 0.01, name  # bf16's is far smaller


@CPU_FP8
def test_a_swapped_layer_takes_a_strided_input():
    """SDXL's transformers project a permuted view (use_linear_projection: `proj_in` of (B, H*W, C) from (B, C, H, W));
    torchao's rowwise cast of it could not be flattened (an H200 run of the SDXL full fine-tune failed so)."""
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    model = Transformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=32, cross_attention_dim=32,
                               norm_num_groups=8, use_linear_projection=True)
    assert train_in_fp8(model, "cpu") > 0 and isinstance(model.proj_in, Float8Linear)
    x = torch.randn(2, 32, 4, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, encoder_hidden_states=torch.randn(2, 5, 32)).sample
    out.float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_a_swapped_layer_takes_a_row_count_that_is_not_a_multiple_of_16():
    """The weight gradient's product runs over the input's rows: SDXL's cross-attention reads 77 text tokens, 616 rows
    at batch 8, which an H100 run refused ("Expected self.size(1) to be divisible by 16"). The meta device checks the
    shapes as the GPU kernels do; the CPU kernel (where it takes rowwise scales) gives the padded product's values."""
    layer = nn.Sequential(nn.Linear(32, 48, dtype=torch.bfloat16, device="meta"))
    assert train_in_fp8(layer, "cpu") == 1  # narrow: swapped only where fp8 is for checking, as here
    x = torch.randn(2, 77, 32, dtype=torch.bfloat16, device="meta", requires_grad=True)
    layer(x).sum().backward()
    assert x.grad.shape == x.shape and layer[0].weight.grad.shape == (48, 32)
    if fp8_matmul_problem(torch.device("cpu")) is None:
        g = torch.Generator().manual_seed(0)
        exact = nn.Linear(32, 48)
        x = torch.randn(2, 77, 32, generator=g)
        exact(x).square().sum().backward()
        swapped = nn.Sequential(nn.Linear(32, 48))
        swapped.load_state_dict({"0." + k: v for k, v in exact.state_dict().items()})
        train_in_fp8(swapped, "cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = swapped(x)
        out.float().square().sum().backward()
        error = (swapped[0].weight.grad - exact.weight.grad).norm() / exact.weight.grad.norm()
        assert 0.01 < error < 0.08, error.item()  # fp8's rounding of both operands, as above


def test_the_config_takes_fp8_compute_on_a_full_fine_tune_but_not_across_sharded_replicas():
    base = ['adapter.type="none"', 'train.precision="bf16"', "train.fp8_compute=true"]
    config = load_config(FLUX, base)
    assert config.quantised_base is None  # nothing frozen is stored in fp8
    with pytest.raises(ConfigError, match="sharded replicas"):
        load_config(FLUX, base + ["pipeline.stages=1", "pipeline.data_parallel=2", "pipeline.data_parallel_shard=true", "pipeline.microbatches=1",
                                  "train.batch_size=4"])
    with pytest.raises(ConfigError, match='train.precision = "bf16"'):
        load_config(FLUX, base + ['train.precision="fp32"'])


@CPU_FP8
def test_the_tiny_flux_full_fine_tune_trains_in_fp8_on_one_and_two_stages_to_the_same_losses(tmp_path):
    quick = ["--set", "train.max_steps=4", "--set", 'adapter.type="none"', "--set", 'train.precision="bf16"',
             "--set", "output.sample_every_end=false", "--set", "checkpoint.every=0", "--set", "observe.log_every=0"]
    losses = {}
    for name, extra in (("fp8 compute, 1 stage", ["train.fp8_compute=true", "pipeline.stages=1"]),
                        ("fp8 compute, 2 stages", ["train.fp8_compute=true", "pipeline.stages=2"]),
                        ("bf16, 1 stage", ["pipeline.stages=1"])):
        run = tmp_path / name.replace(" ", "_").replace(",", "")
        result = run_command(["train", str(FLUX), "--output-dir", str(run), *quick,
                              *[arg for setting in extra for arg in ("--set", setting)]])
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("trained linear layers" in result.stdout) == ("fp8 compute" in name), result.stdout[-2000:]
        losses[name] = losses_of(run)
    one, two, bf16 = (torch.tensor(losses[n]) for n in losses)
    torch.testing.assert_close(two, one, rtol=1e-4, atol=0)
    assert not torch.equal(one, bf16) and torch.allclose(one, bf16, rtol=0.05)
    # the weights keep diffusers' names: they load into the model whole
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(load_config(FLUX).model.path, subfolder="transformer")
    start = model.proj_out.weight.detach().clone()
    weights = load_file(tmp_path / "fp8_compute_2_stages" / "model.safetensors")
    assert model.load_state_dict(weights, strict=True)
    assert not torch.equal(model.proj_out.weight, start)  # trained
