"""`diffpipe plan --probe`: each planned stage run alone with the micro-batches 1F1B keeps in flight there."""
from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

from diffpipe.build import build_backbone, choose_attention
from diffpipe.cli import main
from diffpipe.config_files import load_config
from diffpipe.models.families.flux.flux import FluxFamily
from diffpipe.train import probe
from diffpipe.planner.plan import hardware, make_plan

EXAMPLES = Path(__file__).parent.parent.parent / "examples"
DIGITS, FLUX = EXAMPLES / "digits.toml", EXAMPLES / "flux_tiny.toml"


def test_probe_runs_every_planned_stage_beside_its_plan(capsys):
    code = main(["plan", str(DIGITS), "--json", "--probe-unsplit", "--set", "pipeline.stages=3",
                 "--set", "pipeline.microbatches=4", "--set", "pipeline.checkpointing=[1]"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    unsplit, *stages = result["probed"]
    assert unsplit["stage"] == "unsplit" and unsplit["probed_ms"] > 0
    planned = result["planned"]["stages"]
    assert [r["stage"] for r in stages] == [s["stage"] for s in planned] == [0, 1, 2]
    assert [r["units"] for r in stages] == [s["units"] for s in planned]
    assert [r["in_flight"] for r in stages] == [3, 2, 1]  # 1F1B: stages - s
    assert [r["checkpointed"] for r in stages] == [False, True, False]
    for r in stages:
        assert r["probed_ms"] > 0 and r["planned_ms"] > 0
        assert abs(r["time_error"] - (r["planned_ms"] / r["probed_ms"] - 1)) < 0.01
        assert r["probed_peak_gib"] is None  # peak memory is measured on CUDA only


def test_probe_prints_a_table_after_the_plan(capsys):
    assert main(["plan", str(DIGITS), "--probe"]) == 0
    out = capsys.readouterr().out
    assert out.index("planned split") < out.index("each planned stage run alone on cpu")
    assert "probed ms" in out


def test_probe_with_a_world_size_probes_the_best_layout(capsys):
    assert main(["plan", str(DIGITS), "--world-size", "2", "--probe", "--json"]) == 0
    best, *others = json.loads(capsys.readouterr().out)
    assert len(best["probed"]) == len(best["planned"]["stages"])
    assert all("probed" not in other for other in others)


def test_the_probed_speed_is_the_plans_with_the_probed_stage_times(capsys):
    assert main(["plan", str(DIGITS), "--json", "--probe", "--set", "pipeline.stages=2",
                 "--set", "pipeline.microbatches=4"]) == 0
    result = json.loads(capsys.readouterr().out)
    slowest = max(r["probed_ms"] + s["send_ms"] for r, s in zip(result["probed"], result["planned"]["stages"]))
    batch = result["micro_batch_size"] * 4
    assert result["probed_samples_per_s"] == pytest.approx(batch / ((4 + 2 - 1) * slowest / 1e3), rel=1e-3)


def test_each_stage_is_probed_as_the_run_builds_it(monkeypatch):
    """LoRA adapters, a bf16 base and the run's optimizer: a probe of the plain fp32 model would hold several
    times the memory a LoRA run's stage holds. Received tensors need gradients as the pipeline's do: a LoRA Flux's
    rotary embedding none (given one, every block of an H200 stage kept 0.29 GiB more)."""
    config = load_config(FLUX, ["adapter.type=\"lora\"", "memory.base_dtype=\"bf16\"", "train.precision=\"bf16\"",
                                "pipeline.stages=2",
                                "pipeline.microbatches=2"])
    meta = build_backbone(config, "meta")
    plan = make_plan(config, meta, 2, 1, 2, hardware(config))
    seen = []

    def record(module, received, conditions, device, held, repeats, optimizer, config):
        seen.append(({n: q.dtype for n, q in module.named_parameters() if not q.requires_grad},
                     [n for n, q in module.named_parameters() if q.requires_grad],
                     {n: t.requires_grad for n, t in zip(module.spec.receives, received)}))
        return 0.01, None

    monkeypatch.setattr(probe, "probe_stage", record)
    rows = probe.probe_plan(config, meta, plan, torch.device("cpu"))
    assert [r["stage"] for r in rows] == [0, 1] and len(seen) == 2
    for frozen, trained, _ in seen:
        assert trained and all("lora_" in n for n in trained)
        assert frozen and all(dtype == torch.bfloat16 for dtype in frozen.values())
    assert seen[0][2] == {"sample": False}
    assert seen[1][2]["rope"] is False and seen[1][2]["h"] is True


def test_a_lora_runs_stages_are_probed_on_the_cpu(capsys):
    """Stage 0 of a LoRA Flux sends tensors no trained weight made (the rotary embedding): the probe's backward
    takes the others (it failed on them once)."""
    assert main(["plan", str(FLUX), "--json", "--probe", "--set", 'adapter.type="lora"', "--set",
                 "pipeline.stages=2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["stage"] for r in result["probed"]] == [0, 1]
    assert all(r["probed_ms"] > 0 for r in result["probed"]) and result["probed_samples_per_s"] > 0


@pytest.mark.parametrize("config, refused, off", [(FLUX, True, True), (FLUX, False, False), (DIGITS, False, False),
                                                   (EXAMPLES / "chroma_tiny.toml", False, False),
                                                   (EXAMPLES / "flux_kontext_tiny.toml", False, False)])
def test_families_whose_backward_fails_in_cudnn_attention_turn_it_off_on_cuda(config, refused, off, monkeypatch):
    """Flux's backward once met an illegal memory access in cuDNN attention on an H200 (the probe did not turn it
    off while the trainer did); every stage built on CUDA turns it off for a family that sets `cudnn_attention`
    False. Flux, Chroma and Kontext no longer do (their units hand the attention a contiguous gradient: flux.py
    `_Block`; each seen training on cuDNN's kernels on a GPU)."""
    if refused:
        monkeypatch.setattr(FluxFamily, "cudnn_attention", False)
    backbone = build_backbone(load_config(config), "meta")
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        choose_attention(backbone, torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        choose_attention(backbone, torch.device("cuda"))
        assert torch.backends.cuda.cudnn_sdp_enabled() is not off
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_a_probed_stage_is_freed_before_the_next_is_built(monkeypatch):
    """With the cycle collector left to run when it likes (here: not at all), a probed stage's weights stayed held
    while the next stage was built: on a GPU the next stage ran out of memory."""
    config = load_config(FLUX, ["adapter.type=\"lora\"", "pipeline.stages=2", "pipeline.microbatches=2"])
    meta = build_backbone(config, "meta")
    plan = make_plan(config, meta, 2, 1, 2, hardware(config))
    earlier, held_then = [], []

    def record(module, *args):
        held_then.append([ref() is not None for ref in earlier])
        earlier.append(weakref.ref(next(q for q in module.parameters() if not q.requires_grad)))
        return 0.01, None

    monkeypatch.setattr(probe, "probe_stage", record)
    gc.collect()
    gc.disable()
    try:
        probe.probe_plan(config, meta, plan, torch.device("cpu"))
    finally:
        gc.enable()
    assert held_then == [[], [False]]
