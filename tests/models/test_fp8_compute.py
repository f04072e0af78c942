"""train.fp8_compute: a frozen fp8 linear layer's forward and input gradient are the fp8 products of its quantised
operands with their scales, exactly (on values where fp32 sums are exact, the reference computed in float64 apart
from the layer's code); on Gaussian operands they stay within fp8's rounding of the fp32 product and are not bf16's
product (a silent fallback); the config and the device refuse what cannot compute so; the tiny Flux LoRA trains with
it on 1 and 2 stages to the same losses, near the fp8-storage run's."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from diffpipe.config import ConfigError
from diffpipe.config_files import load_config
from diffpipe.models.storage import FrozenStorage
from diffpipe.models.stored_linear import FP8, FP8_MAX, Fp8Linear
from diffpipe.torch_support import _minor, fp8_matmul_problem

from ..helpers import losses_of, run_command

FLUX = Path(__file__).parent.parent.parent / "examples" / "flux_tiny.toml"
CPU_FP8 = pytest.mark.skipif(fp8_matmul_problem(torch.device("cpu")) is not None,
                             reason="this torch's CPU kernel takes one scale per tensor (torch 2.13 has rowwise)")


def _integers(rows: int, columns: int, largest: int, generator: torch.Generator) -> torch.Tensor:
    """Integers in [-largest, largest] with one entry of each row at +-448 (fp8's largest): times a power of two,
    a row's scale (its largest / 448) is that power of two exactly."""
    values = torch.randint(-largest, largest + 1, (rows, columns), generator=generator).double()
    place = torch.randint(0, columns, (rows,), generator=generator)
    sign = torch.randint(0, 2, (rows,), generator=generator).double() * 2 - 1
    values[torch.arange(rows), place] = FP8_MAX * sign
    return values


def _exact_case():
    """A 48 -> 32 layer whose row r has scale 2^(r % 4 - 7) and a batch of inputs and output gradients built so that
    every quantised operand is an integer and every fp32 sum is exact (below 2^24)."""
    g = torch.Generator().manual_seed(0)
    out_features, in_features = 32, 48
    row_scale = 2.0 ** (torch.arange(out_features) % 4 - 7).double()
    weight = _integers(out_features, in_features, 40, g) * row_scale[:, None]
    x_scale = 2.0 ** torch.randint(-3, 3, (10, 1), generator=g).double()
    x = _integers(10, in_features, 40, g) * x_scale
    # the output gradient: its column 0 is +-448, others at most 40, so (g * s) row's largest is at column 0, whose
    # scale (2^-7) is the smallest: (g * s) / its row scale is an integer times 1, 2, 4 or 8, at most 320
    g_scale = 2.0 ** torch.randint(-2, 2, (10, 1), generator=g).double()
    grad = torch.randint(-40, 41, (10, out_features), generator=g).double()
    grad[:, 0] = FP8_MAX
    grad = grad * g_scale
    return weight, x, grad, row_scale


def _reference(weight, x, grad, row_scale):
    """The layer's output (bias 0) and input gradient from the operands quantised here, products in float64."""
    w8 = (weight / row_scale[:, None]).to(FP8).double()
    x_rows = x.abs().amax(dim=1, keepdim=True) / FP8_MAX
    y = ((x / x_rows).to(FP8).double() @ w8.T * x_rows * row_scale[None, :]).to(torch.bfloat16)
    scaled = grad.to(torch.bfloat16).double() * row_scale[None, :]
    g_rows = scaled.abs().amax(dim=1, keepdim=True) / FP8_MAX
    dx = ((scaled / g_rows).to(FP8).double() @ w8 * g_rows).to(torch.bfloat16)
    return y, dx


def _fp8_layer(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp8Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    FrozenStorage(torch.bfloat16, linear="fp8", fp8_compute=True).store(layer.requires_grad_(False))
    return layer


def _run(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(grad.to(y.dtype))
    return y, x.grad


@CPU_FP8
def test_the_forward_and_input_gradient_are_exactly_the_fp8_products_with_their_scales():
    weight, x, grad, row_scale = _exact_case()
    layer = _fp8_layer(weight.float())
    assert layer.fp8_compute and "computed in fp8" in repr(layer)
    assert torch.equal(layer.weight_scale.double().view(-1), row_scale)  # the case is as built
    y, dx = _run(layer, x, grad)
    y_ref, dx_ref = _reference(weight, x, grad, row_scale)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.float32
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref.float())
    # the inputs are not fp8 values themselves: a product without quantising them (fp8 storage's) differs
    stored_only = _fp8_layer(weight.float())
    stored_only.fp8_compute = False
    y_stored, dx_stored = _run(stored_only, x, grad)
    assert not torch.equal(y_stored, y_ref) and not torch.equal(dx_stored, dx_ref.float())


@CPU_FP8
def test_the_bias_is_added_in_bf16_after_the_product():
    weight, x, grad, row_scale = _exact_case()
    bias = torch.arange(32).double() / 4
    y, _ = _run(_fp8_layer(weight.float(), bias.float()), x, grad)
    y_ref, _ = _reference(weight, x, grad, row_scale)
    assert torch.equal(y, y_ref + bias.to(torch.bfloat16))


@CPU_FP8
def test_on_gaussian_operands_fp8_compute_is_within_fp8_rounding_and_is_not_a_bf16_product():
    torch.manual_seed(0)
    twin = nn.Linear(256, 128).requires_grad_(False)
    layer = _fp8_layer(twin.weight, twin.bias)
    x, grad = torch.randn(4, 64, 256), torch.randn(4, 64, 128)
    y, dx = _run(layer, x, grad)
    x_ref = x.clone().requires_grad_()
    y_ref = twin(x_ref)
    y_ref.backward(grad)
    y_error = float((y.detach().float() - y_ref.detach()).norm() / y_ref.norm())
    dx_error = float((dx - x_ref.grad).norm() / x_ref.grad.norm())
    # each operand within 2^-4 of itself, rounded to nearest (a random sign): about 2^-4 / sqrt(3) each, both ~5 %
    assert 0.01 < y_error < 0.06 and 0.01 < dx_error < 0.06, (y_error, dx_error)
    bf16_error = float((twin(x.bfloat16().float()) - y_ref).norm() / y_ref.norm())
    assert bf16_error < 0.01  # what a bf16 product would have given instead


def test_layers_whose_sides_are_not_multiples_of_16_compute_as_fp8_storage_does():
    layer = _fp8_layer(torch.randn(24, 48))
    assert isinstance(layer, Fp8Linear) and not layer.fp8_compute


@pytest.mark.torch_smoke
def test_the_cpu_runs_fp8_products_from_torch_2_13_and_says_so_before():
    problem = fp8_matmul_problem(torch.device("cpu"))
    if _minor(torch.__version__) >= (2, 13):
        assert problem is None
    else:
        assert problem.startswith("train.fp8_compute: torch") and "pip install 'torch==2.13.0'" in problem


@pytest.mark.parametrize("setting, words", [
    (['adapter.type="dora"'], "DoRA"),
    (['memory.base_dtype="bf16"'], 'memory.base_dtype = "fp8"'),
    (['train.precision="fp16"'], 'train.precision = "bf16"'),
])
def test_the_config_refuses_what_fp8_compute_cannot_run(setting, words):
    base = ['adapter.type="lora"', 'train.precision="bf16"', "train.fp8_compute=true"]
    with pytest.raises(ConfigError, match="train.fp8_compute") as error:
        load_config(FLUX, base + setting)
    assert words in str(error.value)
    load_config(FLUX, base)  # and accepts it otherwise


@CPU_FP8
def test_the_tiny_flux_lora_trains_with_fp8_compute_on_one_and_two_stages_to_the_same_losses(tmp_path):
    quick = ["--set", "train.max_steps=4", "--set", 'adapter.type="lora"', "--set", 'train.precision="bf16"',
             "--set", "output.sample_every_end=false", "--set", "checkpoint.every=0", "--set", "observe.log_every=0",
             "--set", "output.save_weights=false"]
    losses = {}
    for name, extra in (("fp8 compute, 1 stage", ["train.fp8_compute=true", "pipeline.stages=1"]),
                        ("fp8 compute, 2 stages", ["train.fp8_compute=true", "pipeline.stages=2"]),
                        ("fp8 storage, 1 stage", ['memory.base_dtype="fp8"', "pipeline.stages=1"])):
        run = tmp_path / name.replace(" ", "_").replace(",", "")
        result = run_command(["train", str(FLUX), "--output-dir", str(run), *quick,
                              *[arg for setting in extra for arg in ("--set", setting)]])
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("train.fp8_compute: " in result.stdout) == ("fp8 compute" in name)
        losses[name] = losses_of(run)
    one, two, stored = (torch.tensor(losses[n]) for n in losses)
    torch.testing.assert_close(two, one, rtol=1e-4, atol=0)
    # fp8 compute is another arithmetic than fp8 storage: close, not equal
    assert not torch.equal(one, stored) and torch.allclose(one, stored, rtol=0.05)


def test_the_planner_counts_the_fp8_products_and_times_them_faster_by_the_measured_factor():
    """UnitCost.fp8_product_flops is one forward's FLOPs of the frozen linear layers fp8 takes (counted here from
    each layer's input rows apart from the planner's hooks); with train.fp8_compute each pass costs those products
    1 - 1/FP8_PRODUCT_SPEEDUP less than bf16, and no dequantisation."""
    from diffpipe.build import build_backbone
    from diffpipe.models.storage import FP8_PRODUCT_SPEEDUP, quantisable
    from diffpipe.planner.partition import Hardware
    from diffpipe.planner.costs import count_unit_costs
    from diffpipe.planner.plan import _replicas, example_inputs, unit_costs

    sets = ['adapter.type="lora"', 'train.precision="bf16"', "pipeline.stages=1", 'pipeline.compile="blocks"']
    config = load_config(FLUX, sets + ["train.fp8_compute=true"])
    backbone = build_backbone(config, "meta")
    costs = unit_costs(config, backbone, 1)
    rows = {}  # each frozen linear layer's input rows in one forward, seen by a hook of this test's own

    def seen(layer, inputs, output):
        rows[layer] = rows.get(layer, 0) + inputs[0].numel() // layer.in_features
    layers = [m for m in backbone.model.modules() if quantisable(m)]
    assert layers and all(m.in_features % 16 == 0 and m.out_features % 16 == 0 for m in layers)
    hooks = [m.register_forward_hook(seen) for m in layers]
    count_unit_costs(backbone, *example_inputs(config, backbone, 1), torch.bfloat16, torch.bfloat16,
                     twins=False)  # one sample, every unit run (a twin runs no hook)
    for hook in hooks:
        hook.remove()
    expected = sum(2 * n * m.in_features * m.out_features for m, n in rows.items())
    assert sum(c.fp8_product_flops for c in costs) == expected > 0

    hw = Hardware(tflops=1.0)
    computed = _replicas(config, 1, 1)
    bf16 = _replicas(load_config(FLUX, sets + ['memory.base_dtype="bf16"']), 1, 1)
    unit = max(costs, key=lambda c: c.fp8_product_flops)
    saved = unit.fp8_product_flops * (1 - 1 / FP8_PRODUCT_SPEEDUP["compiled"]) / 1e12
    for bf16_s, fp8_s in zip(bf16.unit_times(unit, hw), computed.unit_times(unit, hw)):
        assert fp8_s == pytest.approx(bf16_s - saved)


@CPU_FP8
def test_a_lora_trained_with_fp8_compute_loads_into_the_bf16_pipeline_near_the_trained_models_output(tiny, tmp_path):
    """The issue's quality check of an export: the adapters of an fp8-compute run, exported for diffusers, load into
    FluxPipeline in bf16, whose prediction is within 10 % (relative, Frobenius) of the model as it trained (the same
    adapters over the base held and computed in fp8, under bf16 autocast), and what the adapters change is what they
    changed there, within 25 % of it: fp8's rounding of the products is the difference."""
    from diffusers import FluxPipeline

    from diffpipe.cli import main

    from .test_dit_pipeline_folder import _flux_output

    run = tmp_path / "run"
    result = run_command(["train", str(FLUX), "--output-dir", str(run), "--set", "train.max_steps=8",
                          "--set", 'adapter.type="lora"', "--set", "adapter.rank=4", "--set", "adapter.alpha=8.0",
                          "--set", 'train.precision="bf16"', "--set", "train.fp8_compute=true",
                          "--set", "train.learning_rate=3e-2", "--set", "train.warmup_steps=0",
                          "--set", "pipeline.stages=1", "--set", "output.sample_every_end=false",
                          "--set", "checkpoint.every=0", "--set", "observe.log_every=0"])
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "lora"
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 0

    def outputs(pipe, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The prediction with the exported adapters loaded, and without them."""
        pipe.load_lora_weights(out / "pytorch_lora_weights.safetensors")
        if autocast:  # the model as it trained: its base's linear weights held and computed in fp8
            storage = FrozenStorage(torch.bfloat16, linear="fp8", fp8_compute=True)
            for module in pipe.transformer.modules():
                storage.store(module)
            assert any(getattr(m, "fp8_compute", False) for m in pipe.transformer.modules())
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # bf16: inputs cast as the pipeline does
            adapted = _flux_output(pipe.transformer).float()
            pipe.disable_lora()
            base = _flux_output(pipe.transformer).float()
        return adapted, base

    trained, trained_base = outputs(FluxPipeline.from_pretrained(tiny / "flux"), autocast=True)
    loaded, loaded_base = outputs(FluxPipeline.from_pretrained(tiny / "flux", torch_dtype=torch.bfloat16), False)
    change, change_there = loaded - loaded_base, trained - trained_base
    off = float((loaded - trained).norm() / trained.norm())
    change_off = float((change - change_there).norm() / change_there.norm())
    assert float(change_there.norm() / trained.norm()) > 0.05  # the adapters matter
    assert off < 0.10 and change_off < 0.25, (off, change_off)


@pytest.mark.parametrize("setting", ['memory.base_dtype="fp8"', 'memory.base_dtype="int8"', "train.fp8_compute=true"])
def test_a_quantised_base_is_refused_across_sharded_replicas_before_training(setting):
    """Sharded replicas (FSDP2) cut each fp8/int8 weight but not its scale per row: such a run trained and then failed
    writing its weights ("mixed torch.Tensor and DTensor", seen on the CPU with the digits LoRA over 2 replicas),
    losing the run. Refused by the config; and the planner never picks a quantised base for sharded replicas."""
    from diffpipe.config_files import build_config

    sharded = {"pipeline": {"stages": 1, "data_parallel": 2, "data_parallel_shard": True},
               "train": {"precision": "bf16", "batch_size": 8}, "adapter": {"type": "lora"}}
    with pytest.raises(ConfigError, match="pipeline.data_parallel_shard = false"):
        load_config(FLUX, ['adapter.type="lora"', 'train.precision="bf16"', "pipeline.stages=1",
                           "pipeline.data_parallel=2", "pipeline.data_parallel_shard=true", setting])
    build_config(sharded)  # a bf16 base shards

    from diffpipe.planner.levers import _settings
    from diffpipe.planner.plan import _replicas

    auto = build_config({**sharded, "memory": {"base_dtype": "auto", "quantise_if_needed": ["fp8", "nf4"]}})
    formats = {choice.base_dtype for choice, _ in _settings(auto, _replicas(auto, 1, 2))}
    assert formats == {"auto"}
    unsharded = build_config({**sharded, "pipeline": {"stages": 1, "data_parallel": 2},
                              "memory": {"base_dtype": "auto", "quantise_if_needed": ["fp8", "nf4"]}})
    assert {c.base_dtype for c, _ in _settings(unsharded, _replicas(unsharded, 1, 2))} == {"auto", "fp8", "nf4"}


def test_a_layout_search_never_plans_a_quantised_base_across_sharded_replicas():
    """`diffpipe plan --world-size N` from a config of one replica with data_parallel_shard = true: the layouts it
    tries with several replicas shard them, so they neither choose a quantised base (base_dtype "auto") nor plan
    the config's own (fp8 here), which such a run could not write (the test above)."""
    from diffpipe.build import build_backbone
    from diffpipe.config_files import build_config
    from diffpipe.planner.levers import _settings
    from diffpipe.planner.plan import _replicas, hardware, layouts_tried

    one = {"pipeline": {"stages": 1, "data_parallel": 1, "data_parallel_shard": True},
           "train": {"precision": "bf16", "batch_size": 8}, "adapter": {"type": "lora"},
           "memory": {"base_dtype": "auto", "quantise_if_needed": ["fp8", "nf4"]}}
    auto = build_config(one)
    assert {c.base_dtype for c, _ in _settings(auto, _replicas(auto, 1, 2))} == {"auto"}  # 2 sharded replicas
    assert {c.base_dtype for c, _ in _settings(auto, _replicas(auto, 1, 1))} == {"auto", "fp8", "nf4"}

    config = load_config(FLUX, ['adapter.type="lora"', 'train.precision="bf16"', "pipeline.stages=1",
                                "pipeline.data_parallel_shard=true", 'memory.base_dtype="fp8"', "train.batch_size=2",
                                "pipeline.microbatches=1", 'train.device="cpu"'])
    tried = layouts_tried(config, build_backbone(config, "meta"), 2, hardware(config))
    refused = [why for plan, why in tried if plan is None and "cannot cut a base held in fp8" in why]
    planned = [plan for plan, _ in tried if plan is not None]
    assert refused and all("1 process(es) x 2 replica(s)" in why for why in refused)
    assert planned and all(plan.data_parallel == 1 for plan in planned)  # 2 stages of one replica still planned


def test_auto_fp8_compute_is_on_where_blocks_compile_on_an_fp8_gpu_and_off_elsewhere_never_refused(capsys):
    """train.fp8_compute = "auto" (issue 54 item 4): on where the planner counts it faster at no more memory
    (compiled blocks, a GPU with fp8 tensor cores: a plan made here, with no GPU, assumes one), planned as `true`
    is; off eager, on the CPU, and for what `true` refuses (full fine-tune, DoRA, another base, fp32, sharded
    replicas), none of which refuses "auto"; the launcher resolves it before planning and says so."""
    from diffpipe.build import build_backbone
    from diffpipe.planner.plan import hardware, make_plan, planned_storage
    from diffpipe.precision import fp8_compute_on
    from diffpipe.preflight import check_before_launch

    auto = ['adapter.type="lora"', 'train.precision="bf16"', 'train.fp8_compute="auto"', 'pipeline.compile="blocks"',
            "pipeline.stages=1", "pipeline.microbatches=1", "train.batch_size=2"]
    config = load_config(FLUX, auto)
    assert not torch.cuda.is_available()  # the suite's machine: plans assume a GPU with fp8
    assert fp8_compute_on(config, "cuda") and not fp8_compute_on(config, "cpu")
    assert planned_storage(config).fp8_compute is True and planned_storage(config).linear == "fp8"
    eager = planned_storage(load_config(FLUX, auto + ["pipeline.compile=false"]))
    assert eager.fp8_compute is False and eager.linear is None  # the "auto" base: bf16 on a GPU
    meta, hw = build_backbone(config, "meta"), hardware(config)
    speed = {value: make_plan(load_config(FLUX, auto + [f"train.fp8_compute={value}"]), meta, 1, 1, 1, hw).samples_per_s
             for value in ("true", "false", '"auto"')}
    assert speed['"auto"'] == speed["true"] > speed["false"]
    for setting in ("pipeline.compile=false", 'adapter.type="none"', 'adapter.type="dora"',
                    'memory.base_dtype="bf16"', 'train.precision="fp32"'):
        assert not fp8_compute_on(load_config(FLUX, auto + [setting]), "cuda"), setting  # and loads: not refused
    sharded = auto + ["pipeline.data_parallel=2", "pipeline.data_parallel_shard=true", "train.batch_size=4"]
    assert not fp8_compute_on(load_config(FLUX, sharded), "cuda")

    checked = check_before_launch(load_config(FLUX, auto + ['train.device="cpu"']))
    assert checked.fp8_compute is False and 'train.fp8_compute = "auto": off' in capsys.readouterr().out
