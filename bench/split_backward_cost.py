"""Host time of the zero-bubble schedules' split backward on a model's autograd graph, without a GPU: the graph
analysis torch's `stage_backward_input` repeats for every micro-batch and stage, the parameter groups its weight
pass calls `autograd.grad` for one by one, and diffpipe's one-time check of the same graph (pipeline/zero_bubble.py).

    python bench/split_backward_cost.py                 # the SDXL UNet config, built and run on the meta device
    python bench/split_backward_cost.py --preset sd15
"""
from __future__ import annotations

import argparse
import time

import torch
from diffusers import UNet2DConditionModel
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, construct_reverse_graph, get_param_groups

from diffpipe.models.families.unet.presets import UNET_PRESETS
from diffpipe.pipeline.zero_bubble import missed_parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="sdxl", choices=sorted(UNET_PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    cfg = UNET_PRESETS[args.preset]
    with torch.device("meta"):
        model = UNet2DConditionModel(**cfg)
        size = cfg.get("sample_size", 64)
        x = torch.randn(args.batch, cfg.get("in_channels", 4), size, size, requires_grad=True)
        text = torch.randn(args.batch, 77, cfg["cross_attention_dim"])
        extra = {}
        if cfg.get("addition_embed_type") == "text_time":
            extra = {"added_cond_kwargs": {"text_embeds": torch.randn(args.batch, 1280),
                                           "time_ids": torch.randn(args.batch, 6)}}
        out = model(x, torch.ones(args.batch), text, **extra).sample
    params = list(model.parameters())
    start = time.perf_counter()
    reverse = construct_reverse_graph([out.grad_fn])
    groups = get_param_groups([_get_grad_fn_or_grad_acc(x)], [_get_grad_fn_or_grad_acc(p) for p in params], reverse)
    torch_s = time.perf_counter() - start
    start = time.perf_counter()
    missed = missed_parameters([out], [x], model.named_parameters())
    check_s = time.perf_counter() - start
    print(f"{args.preset}: {len(reverse)} autograd nodes, {len(params)} parameters; torch's graph analysis per "
          f"micro-batch {torch_s:.2f} s, {len(groups)} parameter groups (one autograd.grad call each in the weight "
          f"pass); diffpipe's one-time check {check_s:.2f} s, {len(missed)} parameters it would miss")


if __name__ == "__main__":
    main()
