"""memory.base_dtype = "bf16": a LoRA run's frozen base is stored in bf16 (half its memory), the adapters stay fp32,
training under bf16 autocast follows the fp32-base run, the weights saved merge the adapters in fp32 into the base
as model.path holds it (not its bf16 copy), and the planner charges the frozen weights 2 bytes each."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe.build import build_backbone, give_weights
from diffpipe.config import ConfigError
from diffpipe.config_files import build_config, load_config
from diffpipe.planner.partition import Replicas
from diffpipe.planner.plan import _replicas
from diffpipe.models.storage import FrozenStorage
from diffpipe.models.stored_linear import Fp8Linear
from diffpipe.precision import frozen_storage

from ..helpers import run_command

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "digits_lora.toml"
QUICK = ["--set", "train.max_steps=5", "--set", "train.batch_size=32", "--set", 'train.precision="bf16"',
         "--set", "output.sample_every_end=false", "--set", "observe.log_every=0", "--set", "checkpoint.every=0"]


def _train(run: Path, base: str) -> list[float]:
    cmd = ["train", str(EXAMPLE), "--output-dir", str(run), *QUICK,
           "--set", f'memory.base_dtype="{base}"']
    result = run_command(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_frozen_weights_are_stored_in_bf16_and_adapters_stay_fp32():
    config = load_config(EXAMPLE)
    backbone = build_backbone(config, "meta")  # with its LoRA layers (added on the meta device only)
    give_weights(backbone, config, frozen=FrozenStorage(torch.bfloat16))  # module by module, as the trainer gives them
    module = backbone.model
    frozen = {p.dtype for p in module.parameters() if not p.requires_grad}
    trained = {p.dtype for p in module.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trained == {torch.float32}


def test_auto_is_bf16_for_lora_on_cuda_under_autocast_only():
    lora = {"adapter": {"type": "lora"}, "train": {"precision": "bf16"}}
    assert frozen_storage(build_config(lora), "cuda").dtype == torch.bfloat16
    assert frozen_storage(build_config(lora), "cpu").dtype == torch.float32
    assert frozen_storage(build_config({"train": {"precision": "bf16"}}), "cuda").dtype == torch.float32
    assert frozen_storage(build_config({"adapter": {"type": "lora"}}), "cuda").dtype == torch.float32  # fp32 compute
    with pytest.raises(ConfigError, match="fp32 compute cannot use"):
        build_config({"memory": {"base_dtype": "bf16"}})


def test_the_planner_charges_frozen_weights_as_stored():
    config = build_config({"adapter": {"type": "lora"}, "train": {"precision": "bf16"}})
    meta = build_backbone(config, "meta")
    from diffpipe.planner.plan import unit_costs

    costs = unit_costs(config, meta, 1)
    frozen = sum(c.params - c.trainable_params for c in costs)
    bf16, fp32 = _replicas(config, 1, 1), Replicas()
    assert fp32.state_bytes(costs) - bf16.state_bytes(costs) == 2 * frozen


def test_a_bf16_base_trains_as_the_fp32_base_and_saves_the_merge_in_fp32(tmp_path):
    """Under bf16 autocast every matrix product already rounds its weight to bf16: step 0's loss is the same, and
    later ones differ only by the norms' bf16-rounded weights (measured: 1.5e-4 relative at step 4)."""
    bf16, fp32 = _train(tmp_path / "bf16", "bf16"), _train(tmp_path / "fp32", "fp32")
    assert bf16[0] == pytest.approx(fp32[0], rel=1e-6)
    assert bf16 == pytest.approx(fp32, rel=2e-3)
    merged = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    adapters = load_file(str(tmp_path / "bf16" / "lora.safetensors"))
    assert {t.dtype for t in merged.values()} == {torch.float32}
    # the base as model.path holds it (here: as seeded, fp32), not its bf16 copy, plus the adapters' update summed
    # in fp32: nothing of the update rounded away, and no rounding of the stored copy kept in the result
    config = load_config(EXAMPLE)
    original = dict(build_backbone(build_config({**config.model_dump(), "adapter": {"type": "none"}}),
                                   "cpu").model.state_dict())
    a, b = adapters["conv_in.lora_A.weight"], adapters["conv_in.lora_B.weight"]
    delta = (b.flatten(1) @ a.flatten(1)).view(original["conv_in.weight"].shape) * config.adapter.alpha / config.adapter.rank
    assert delta.abs().max() > 0 and torch.allclose(merged["conv_in.weight"], original["conv_in.weight"] + delta,
                                                    rtol=0, atol=1e-7)
    untargeted = "down_blocks.0.downsamplers.0.conv.weight"  # not among adapter.target_modules
    assert f"{untargeted.removesuffix('.weight')}.lora_A.weight" not in adapters
    assert torch.equal(merged[untargeted], original[untargeted])
    assert not torch.equal(original[untargeted].to(torch.bfloat16).float(), original[untargeted])  # bf16 would show


FLUX = EXAMPLE.parent / "flux_tiny.toml"


def test_an_fp8_base_holds_linear_weights_in_fp8_and_the_rest_in_bf16():
    config = load_config(FLUX, ['adapter.type="lora"', 'train.precision="bf16"', 'memory.base_dtype="fp8"'])
    backbone = build_backbone(config, "meta")
    give_weights(backbone, config, frozen=frozen_storage(config, "cpu"))
    layers = list(backbone.model.modules())
    fp8 = [m for m in layers if isinstance(m, Fp8Linear)]
    assert fp8 and all(m.weight.dtype == torch.float8_e4m3fn for m in fp8)
    others = {p.dtype for m in layers if not isinstance(m, Fp8Linear)
              for p in m.parameters(recurse=False) if not p.requires_grad}
    assert others == {torch.bfloat16}
    assert {p.dtype for p in backbone.model.parameters() if p.requires_grad} == {torch.float32}
    # the stored bytes: Flux's frozen weights are almost all in linear layers
    frozen = [p for p in backbone.model.parameters() if not p.requires_grad]
    held = sum(p.numel() * p.element_size() for p in frozen)
    assert held < 1.1 * sum(p.numel() for p in frozen)


def test_the_planner_charges_fp8_and_int8_linear_weights_a_byte_nf4_its_share_and_fp32_their_autocast_copies():
    from diffpipe.planner.plan import unit_costs

    config = load_config(FLUX, ['adapter.type="lora"', 'train.precision="bf16"'])
    costs = unit_costs(config, build_backbone(config, "meta"), 1)
    linear = sum(c.frozen_linear_params for c in costs)
    frozen = sum(c.params - c.trainable_params for c in costs)
    assert 0.9 * frozen < linear < frozen
    fp8 = _replicas(load_config(FLUX, ['adapter.type="lora"', 'train.precision="bf16"',
                                       'memory.base_dtype="fp8"']), 1, 1)
    bf16 = _replicas(load_config(FLUX, ['adapter.type="lora"', 'train.precision="bf16"',
                                        'memory.base_dtype="bf16"']), 1, 1)
    fp32 = _replicas(load_config(FLUX, ['adapter.type="lora"', 'train.precision="bf16"',
                                        'memory.base_dtype="fp32"']), 1, 1)
    assert bf16.state_bytes(costs) - fp8.state_bytes(costs) == linear
    for format, held in (("int8", 1.0), ("nf4", 0.5 + 4 / 64)):  # NF4: half a byte, and an fp32 scale per 64
        quantised = _replicas(load_config(FLUX, ['adapter.type="lora"', 'train.precision="bf16"',
                                                 f'memory.base_dtype="{format}"']), 1, 1)
        assert bf16.state_bytes(costs) - quantised.state_bytes(costs) == pytest.approx((2 - held) * linear)
    # per micro-batch in flight, autocast's bf16 copy of every frozen fp32 weight of a linear or convolution layer,
    # besides the copies of the trained (LoRA) weights, which every base has
    trained = sum(c.trained_copy_bytes for c in costs)
    assert trained > 0
    assert sum(fp32.kept_copies_bytes(c) for c in costs) == trained + 2 * sum(c.frozen_product_params for c in costs)
    assert sum(bf16.kept_copies_bytes(c) + fp8.kept_copies_bytes(c) for c in costs) == 2 * trained
