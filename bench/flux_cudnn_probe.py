"""Where does cuDNN's attention fail inside Flux (issue 54)? A `FluxTransformer2DModel` at Flux.1-dev's width with N
double and M single blocks, random bf16 weights, 1024x1024 (4,096 image tokens) + 512 text tokens, three forward and
backward steps under `sdpa_kernel(CUDNN_ATTENTION)`; prints one JSON line: each step "ok" or the error.

    CUDA_LAUNCH_BLOCKING=1 python bench/flux_cudnn_probe.py --double 1 --single 1 [--lora] [--fix hook|sdpa]

--fix hook: each single block's attention hands back a contiguous gradient (a forward hook on `attn`, what
diffpipe's Flux units do); --fix sdpa: every attention output's gradient made contiguous (SDPA wrapped in this
process only, to tell the two apart). Run each case in a process of its own: a failed cuDNN call can leave the
context unusable.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffpipe.models.families.flux.flux import ContiguousGradient  # noqa: E402


def build(args):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = FluxTransformer2DModel(num_layers=args.double, num_single_layers=args.single, guidance_embeds=True)
    finally:
        torch.set_default_dtype(torch.float32)
    if args.lora:
        from peft import LoraConfig, inject_adapter_in_model

        model.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
                                model)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    if args.fix == "hook":
        for block in model.single_transformer_blocks:
            block.attn.register_forward_hook(lambda module, inputs, out: ContiguousGradient.apply(out))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--double", type=int, default=1)
    parser.add_argument("--single", type=int, default=1)
    parser.add_argument("--lora", action="store_true", help="peft's LoRA r16 on the attention, the base frozen")
    parser.add_argument("--fix", choices=["none", "hook", "sdpa"], default="none")
    args = parser.parse_args()
    if args.fix == "sdpa":
        sdpa = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = lambda *a, **k: ContiguousGradient.apply(sdpa(*a, **k))
    model = build(args)
    cuda = dict(device="cuda")
    ids = torch.zeros(4096, 3, **cuda)
    ids[:, 1], ids[:, 2] = torch.arange(64, **cuda).repeat_interleave(64), torch.arange(64, **cuda).repeat(64)
    inputs = dict(hidden_states=torch.randn(1, 4096, 64, **cuda), encoder_hidden_states=torch.randn(1, 512, 4096, **cuda),
                  pooled_projections=torch.randn(1, 768, **cuda), timestep=torch.full((1,), 0.5, **cuda),
                  img_ids=ids, txt_ids=torch.zeros(512, 3, **cuda), guidance=torch.full((1,), 3.5, **cuda),
                  return_dict=False)
    result = {"double": args.double, "single": args.single, "lora": args.lora, "fix": args.fix}
    try:
        for step in range(3):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(**inputs)[0]
            out.float().pow(2).mean().backward()
            torch.cuda.synchronize()
            result[f"step{step}"] = "ok"
    except RuntimeError as e:
        result["error"] = str(e)[:400]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
