"""What each unit saves for backward, counted by the planner on the meta device beside what it saves on a GPU under
autocast (the same saved-tensor hook on real tensors), and what its forward leaves allocated: per unit, so that a
stage the planner gets wrong (issue 33) shows which kind of unit it miscounts. Needs CUDA.

    python bench/unit_memory.py examples/flux_dev.toml --units double.0 single.0 out --set adapter.type='"lora"'

Prints one JSON line per unit: counted, saved and retained GiB (retained: memory_allocated after the forward less
before, which also holds the unit's outputs; saved on the device includes the trained weights' autocast copies,
which the count gives apart). --detail lists the saved tensors (shape, dtype) only one side has.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffpipe.build import build_backbone, build_stages, choose_attention, example_inputs, give_weights  # noqa: E402
from diffpipe.config_files import load_config  # noqa: E402
from torch.func import functional_call  # noqa: E402

from diffpipe.pipeline.split import stage_specs  # noqa: E402
from diffpipe.precision.autocast import CountedAutocast  # noqa: E402
from diffpipe.planner.costs import _count_unit, _FusedAttention, needs_grad, _stored, _unit_inputs  # noqa: E402
from diffpipe.precision import AUTOCAST_DTYPES, frozen_storage  # noqa: E402
from diffpipe.torch_support import view_base  # noqa: E402

GIB = 2**30


def saved_on_device(unit, args: dict[str, torch.Tensor], autocast_dtype,
                    device: torch.device) -> tuple[int, int, list[str]]:
    """(bytes saved for backward, bytes the forward leaves allocated, each saved tensor's shape and dtype) of one
    unit on `device` (retained is 0 off CUDA; a CPU's autocast is not CUDA's, so only a GPU checks the count)."""
    own = {id(p) for p in unit.module.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(t):
        base = view_base(t)
        if id(base) not in own:
            saved[id(base)] = base
        return t

    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = unit(args)
    retained = torch.cuda.memory_allocated() - before if cuda else 0
    nbytes = sum(t.untyped_storage().nbytes() for t in saved.values())
    del out
    return nbytes, retained, described(saved.values())


def described(tensors) -> list[str]:
    return sorted(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors)


def counted_list(unit, named, grad_names, autocast_dtype, frozen_dtype) -> list[str]:
    """What the planner's count saves for the unit, as `described` lists it (weights' copies marked)."""
    stored = _stored(unit.module, frozen_dtype)
    own = {id(p) for p in stored.values()}
    autocast = CountedAutocast(autocast_dtype, list(stored.values()))
    saved = {}

    def pack(t):
        base = view_base(t)
        if id(base) not in own:
            saved[id(base)] = base
        return t.detach()

    args = _unit_inputs(named, unit.reads, grad_names)
    with _FusedAttention(), autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        functional_call(unit.module, stored, args=(), kwargs=args)
    copies = autocast.frozen_copies | autocast.trained_copies
    return sorted(f"{d}{' (weight copy)' if i in copies else ''}"
                  for i, d in ((i, described([t])[0]) for i, t in saved.items()))


def chain_memory(real, first: int, last: int, named_meta: dict, grad_names: set[str], autocast_dtype,
                 device: torch.device) -> dict:
    """Units first..last run as one uncheckpointed stage (forward of all, then one backward): the memory allocated
    before, after the forward, and the peak, in GiB."""
    named = {k: (torch.randn(v.shape, dtype=v.dtype, device=device) if v.is_floating_point()
                 else torch.zeros(v.shape, dtype=v.dtype, device=device)) for k, v in named_meta.items()}
    named = _unit_inputs(named, list(named), grad_names)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        for unit in real.units[first:last + 1]:
            named.update(unit({k: named[k] for k in unit.reads}))
    torch.cuda.synchronize()
    forward_end, forward_peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    outs = [named[k] for k in real.units[last].writes if named[k].requires_grad]
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    torch.cuda.synchronize()
    return {"chain": f"{real.units[first].name}..{real.units[last].name}", "before_gib": round(before / GIB, 3),
            "forward_end_gib": round(forward_end / GIB, 3), "forward_peak_gib": round(forward_peak / GIB, 3),
            "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 3)}


def stage_memory(config, first: int, named_meta: dict, grad_names: set[str], device: torch.device,
                 rounds: int = 3) -> dict:
    """The last stage from unit `first` on, built as runs build it (build.build_stages: memory.base_dtype, LoRA),
    uncheckpointed, one micro-batch forward then backward, `rounds` times: the memory allocated before, after each
    forward, and the peak of each round, in GiB (to tell the stage's runtime apart from the units it runs)."""
    meta = build_backbone(config, "meta")
    specs = stage_specs(meta, [first])
    module = build_stages(config, meta, specs, [1], device, [])[0]
    received = [torch.randn(named_meta[n].shape, dtype=named_meta[n].dtype, device=device) for n in specs[1].receives]
    conditions = {k: torch.randn(v.shape, dtype=v.dtype, device=device) for k, v in named_meta.items()
                  if k in meta.conditions and v.is_floating_point()}
    torch.cuda.synchronize()
    row = {"stage_from": meta.units[first].name, "before_gib": round(torch.cuda.memory_allocated() / GIB, 3)}
    for r in range(rounds):
        torch.cuda.reset_peak_memory_stats()
        args = [t.detach().requires_grad_(n in grad_names) for t, n in zip(received, specs[1].receives)]
        out = module(*args, **conditions)
        out = out if isinstance(out, tuple) else (out,)
        torch.cuda.synchronize()
        row[f"forward_end_{r}"] = round(torch.cuda.memory_allocated() / GIB, 3)
        outs = [o for o in out if o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        del out, outs
        torch.cuda.synchronize()
        row[f"peak_{r}"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        row[f"after_{r}"] = round(torch.cuda.memory_allocated() / GIB, 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--units", nargs="+", required=True, help="unit names to measure")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--chain", nargs=2, metavar=("FIRST", "LAST"),
                        help="also run units FIRST..LAST as one uncheckpointed stage and report its memory")
    parser.add_argument("--stage-from", help="also build the last stage from this unit as runs do and report its "
                        "memory (bench/unit_memory.stage_memory)")
    parser.add_argument("--detail", action="store_true", help="list the saved tensors only one side has")
    parser.add_argument("--device", default="cuda", help="cpu only tries the script (CPU autocast is not CUDA's)")
    args = parser.parse_args()
    config = load_config(args.config, [*args.overrides, f'train.device="{args.device}"'])
    device = torch.device(args.device)
    autocast_dtype = AUTOCAST_DTYPES[config.train.precision]
    backbone = build_backbone(config, "meta")  # counted, as the planner counts
    real = build_backbone(config, "meta")  # the wanted units get weights on the GPU, stored as the run stores them
    names = [u.name for u in backbone.units]
    wanted = [names.index(n) for n in args.units]
    chain = [names.index(n) for n in args.chain] if args.chain else None
    if chain:
        wanted = sorted(set(wanted) | set(range(chain[0], chain[1] + 1)))
    shown = {names.index(n) for n in args.units}
    give_weights(real, config, wanted, device, frozen_storage(config, device.type))
    choose_attention(real, device)
    inputs, conditions = example_inputs(config, backbone, config.micro_batch_size)
    named = {k: v.to("meta") for k, v in {**inputs, **conditions}.items()}
    grad_names = needs_grad(backbone)
    counted_chain = 0
    for index, unit in enumerate(backbone.units):
        meta_args = {k: named[k] for k in unit.reads}
        if args.stage_from and index == names.index(args.stage_from):
            print(json.dumps(stage_memory(config, index, dict(named), grad_names, device)), flush=True)
        if chain and index == chain[0]:
            chain_row = chain_memory(real, chain[0], chain[1], dict(named), grad_names, autocast_dtype, device)
        if index in shown:
            real_args = {k: (torch.randn(v.shape, dtype=v.dtype, device=device) if v.is_floating_point()
                        else torch.zeros(v.shape, dtype=v.dtype, device=device)) for k, v in meta_args.items()}
            real_args = _unit_inputs(real_args, unit.reads, grad_names)
            saved, retained, saved_list = saved_on_device(real.units[index], real_args, autocast_dtype, device)
        stored_dtype = frozen_storage(config, device.type).dtype
        if index in shown and args.detail:
            listed = counted_list(unit, dict(named), grad_names, autocast_dtype, stored_dtype)
        cost = _count_unit(unit, named, grad_names, autocast_dtype, stored_dtype)
        if chain and chain[0] <= index <= chain[1]:
            counted_chain += cost.activation_bytes + cost.trained_copy_bytes
            if index == chain[1]:
                print(json.dumps({**chain_row, "counted_activations_gib": round(counted_chain / GIB, 3)}), flush=True)
        if index in shown:
            row = {"unit": unit.name, "micro_batch": config.micro_batch_size,
                   "counted_gib": round(cost.activation_bytes / GIB, 4), "saved_gib": round(saved / GIB, 4),
                   "retained_gib": round(retained / GIB, 4),
                   "trained_copies_gib": round(cost.trained_copy_bytes / GIB, 4),
                   "outputs_gib": round(sum(cost.output_bytes.values()) / GIB, 4),
                   "input_dtypes": {k: str(v.dtype) for k, v in meta_args.items()}}
            if args.detail:
                row["only_counted"] = sorted((Counter(listed) - Counter(saved_list)).elements())
                row["only_on_device"] = sorted((Counter(saved_list) - Counter(listed)).elements())
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
