"""fp8 attention (models/fp8_attention.py) on the CPU, where its written-out arithmetic runs: the output and the three
gradients stay within fp8's rounding of fp32 attention and are not bf16's (a silent fallback); the backward's delayed
scales come from the previous backward's maxima, and the first backward, calibrated, is as good as the later ones;
micro-batches' backwards in any order; the same under torch.compile (the custom ops' shapes). train.fp8_attention:
the tiny Wan trains with it over 2 stages near its bf16 losses, its self-attention in fp8 and its cross-attention
not; the settings it cannot take are refused. cuDNN's kernels are compared with this arithmetic on a GPU by
`python bench/fp8_attention.py`."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from diffpipe.config import ConfigError
from diffpipe.config_files import load_config
from diffpipe.models.fp8_attention import attend_fp8, attend_in_fp8

from ..helpers import losses_of, run_command

VIDEO = Path(__file__).parent.parent.parent / "examples" / "video_tiny.toml"
FLUX = Path(__file__).parent.parent.parent / "examples" / "flux_tiny.toml"


def _case(sharpness: float, seed: int = 0, tokens: int = 256):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, tokens, 64, generator=g) for _ in range(3))
    return [q * sharpness, k, v], torch.randn(1, 2, tokens, 64, generator=g) * 1e-3


def _attend(function, qkv, grad, dtype=torch.float32) -> list[torch.Tensor]:
    inputs = [t.detach().to(dtype, copy=True).requires_grad_() for t in qkv]
    out = function(*inputs)
    out.backward(grad.to(dtype))
    return [out.detach().float()] + [t.grad.float() for t in inputs]


def _gaps(results, reference) -> list[float]:
    return [((a - b).norm() / b.norm()).item() for a, b in zip(results, reference)]


@pytest.mark.parametrize("sharpness", [1.0, 4.0])
def test_fp8_attention_is_within_fp8_rounding_of_fp32_and_not_bf16(sharpness):
    """Measured: output, dq, dk, dv 6-7 % off fp32 (flat softmax), 9-13 % (peaky); bf16 attention 0.3-0.5 %."""
    qkv, grad = _case(sharpness)
    reference = _attend(F.scaled_dot_product_attention, qkv, grad)
    bf16 = _gaps(_attend(F.scaled_dot_product_attention, qkv, grad, torch.bfloat16), reference)
    maxima = torch.zeros(4)
    fp8 = _gaps(_attend(lambda *t: attend_fp8(*t, maxima), qkv, grad, torch.bfloat16), reference)
    assert all(gap < 0.2 for gap in fp8), fp8
    assert all(gap > 4 * b for gap, b in zip(fp8, bf16)), (fp8, bf16)  # e4m3's 3 bits, not bf16's 8


def test_delayed_scales_are_the_last_backwards_maxima_and_the_first_backward_is_calibrated():
    """maxima after a backward: dq's, dk's and dv's largest magnitudes (as the fp32 gradients give them, within fp8's
    rounding) and dS's, those of the latest backward (a gradient 4x as large: maxima 4x); the first backward, before
    any maxima, is as close to fp32 as the next."""
    qkv, grad = _case(2.0)
    maxima = torch.zeros(4)
    for step, scale in enumerate([1.0, 4.0, 4.0]):
        reference = _attend(F.scaled_dot_product_attention, qkv, grad * scale)
        gaps = _gaps(_attend(lambda *t: attend_fp8(*t, maxima), qkv, grad * scale), reference)
        largest = torch.stack([t.abs().amax() for t in reference[1:]])
        assert torch.allclose(maxima[:3], largest, rtol=0.15), (step, maxima, largest)
        assert maxima[3] > 0
        if step == 0:
            first = gaps
    assert all(a < 1.1 * b + 1e-3 for a, b in zip(first, gaps)), (first, gaps)


def test_micro_batches_backward_in_any_order():
    """A pipeline runs several forwards before their backwards, each backward updating the shared maxima: the
    gradients of each micro-batch are within fp8's rounding of its own fp32 gradients."""
    cases = [_case(2.0, seed) for seed in (1, 2)]
    maxima = torch.zeros(4)
    runs = []
    for qkv, grad in cases:
        inputs = [t.clone().requires_grad_() for t in qkv]
        runs.append((inputs, attend_fp8(*inputs, maxima), grad))
    for inputs, out, grad in reversed(runs):
        out.backward(grad)
    for (qkv, grad), (inputs, out, _) in zip(cases, runs):
        reference = _attend(F.scaled_dot_product_attention, qkv, grad)
        gaps = _gaps([out.detach()] + [t.grad for t in inputs], reference)
        assert all(gap < 0.2 for gap in gaps), gaps


def test_compiled_attention_computes_what_eager_does():
    qkv, grad = _case(2.0)
    eager_maxima, compiled_maxima = torch.zeros(4), torch.zeros(4)
    eager = _attend(lambda *t: attend_fp8(*t, eager_maxima), qkv, grad)
    compiled_attend = torch.compile(attend_fp8, backend="aot_eager", fullgraph=True)
    compiled = _attend(lambda *t: compiled_attend(*t, compiled_maxima), qkv, grad)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(compiled_maxima, eager_maxima, rtol=0, atol=0)


def test_tiny_wan_trains_with_fp8_attention_near_its_bf16_losses(tmp_path):
    """2 stages, 4 micro-batches (their backwards after their forwards, 1F1B): measured 1e-4 to 6e-4 off the bf16
    run's losses over 10 steps, none equal."""
    losses = {}
    for fp8 in (False, True):
        ran = run_command(["train", str(VIDEO), "--output-dir", str(tmp_path / str(fp8)), "--set",
                           "train.max_steps=10", "--set", 'train.precision="bf16"', "--set",
                           f"train.fp8_attention={str(fp8).lower()}", "--set", "output.sample_every_end=false",
                           "--set", "checkpoint.every=0", "--set", "output.save_weights=false"])
        assert ran.returncode == 0, ran.stdout[-2000:]
        assert ("train.fp8_attention: the self-attention of 8 attention layers" in ran.stdout) == fp8
        losses[fp8] = torch.tensor(losses_of(tmp_path / str(fp8)))
    gaps = (losses[True] - losses[False]).abs() / losses[False]
    assert gaps.max() < 5e-3 and gaps.min() > 0, gaps


def _tiny_wan(seed: int = 1):
    from diffusers import WanTransformer3DModel

    from diffpipe.models.families.wan.wan import WAN_PRESETS, WanFamily

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**WAN_PRESETS["digits"])
    inputs = (torch.randn(1, 1, 4, 8, 8), torch.tensor([500]), torch.randn(1, 8, WAN_PRESETS["digits"]["text_dim"]))
    return model, inputs, WanFamily.fp8_attention_processors


def test_only_wans_self_attention_runs_in_fp8():
    """Its self-attention's maxima move in a backward, its cross-attention's (keys from the text) keep none; the
    buffer is not among the weights; a second call converts nothing."""
    model, inputs, processors = _tiny_wan()
    assert attend_in_fp8(model, processors, torch.device("cpu")) == 2 * len(model.blocks)
    assert attend_in_fp8(model, processors, torch.device("cpu")) == 0
    model(*inputs).sample.sum().backward()
    assert all(block.attn1.fp8_attention_maxima.abs().sum() > 0 for block in model.blocks)
    assert all(block.attn2.fp8_attention_maxima.abs().sum() == 0 for block in model.blocks)
    assert "fp8_attention_maxima" not in str(list(model.state_dict()))


def test_fp8_wan_processor_takes_diffusers_steps(monkeypatch):
    """With torch's attention in fp8's place, the processor (diffusers' steps written again) computes exactly what
    diffusers' own does: output and gradients."""
    from diffpipe.models.families.wan.attention import Fp8WanAttnProcessor

    exact = staticmethod(lambda q, k, v, maxima: F.scaled_dot_product_attention(q, k, v))
    monkeypatch.setattr(Fp8WanAttnProcessor, "attend", exact)
    runs = []
    for converted in (False, True):
        model, inputs, processors = _tiny_wan()
        if converted:
            attend_in_fp8(model, processors, torch.device("cpu"))
        out = model(*inputs).sample
        out.square().mean().backward()
        runs.append([out.detach()] + [p.grad for p in model.blocks[0].attn1.parameters()])
    for diffusers, ours in zip(*runs):
        torch.testing.assert_close(ours, diffusers, rtol=0, atol=0)


@pytest.mark.torch_smoke  # custom ops and dynamo's tracing of them change between torch versions
def test_compiled_wan_with_fp8_attention_computes_what_eager_does():
    """torch.compile traces the processor and the custom ops without a break (fullgraph; aot_eager: inductor's
    own kernels would round otherwise): the same output, gradients and maxima as eager."""
    runs = []
    for compiled in (False, True):
        model, inputs, processors = _tiny_wan()
        attend_in_fp8(model, processors, torch.device("cpu"))
        block = model.blocks[1]
        if compiled:
            model.blocks[1] = torch.compile(block, backend="aot_eager", fullgraph=True)
        out = model(*inputs).sample
        out.square().mean().backward()
        runs.append((out.detach(), block.attn1.to_q.weight.grad, block.attn1.fp8_attention_maxima.clone()))
    for eager, compiled in zip(*runs):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.parametrize("setting, words", [("train.precision=\"fp32\"", "train.precision = \"bf16\""),
                                            ("pipeline.sequence_parallel=2", "pipeline.sequence_parallel = 1")])
def test_fp8_attention_refuses_what_it_is_not_built_for(setting, words):
    with pytest.raises(ConfigError, match=words):
        load_config(VIDEO, ["train.fp8_attention=true", 'train.precision="bf16"', setting])


def test_a_family_without_an_fp8_processor_is_refused_before_training(tmp_path, capsys):
    ran = run_command(["train", str(FLUX), "--output-dir", str(tmp_path), "--set", "train.fp8_attention=true",
                       "--set", 'train.precision="bf16"'])
    assert ran.returncode != 0
    assert "flux's attention has no fp8 processor yet: set train.fp8_attention = false" in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists()
