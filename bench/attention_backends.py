"""Attention at Flux.1-dev's shapes through each of torch's SDPA backends (issue 54: attention is 46 % of the
fp8-compute LoRA step, the same FlashAttention-2 kernel in diffpipe and the plain loop): forward + backward time,
TFLOP/s, and the backward's gradients against flash's, for query/key/value laid out as diffusers' attention gives
them ((batch, tokens, heads, dim) transposed: not contiguous) and contiguous. A backend that fails prints its error.

    python bench/attention_backends.py [--layout diffusers|contiguous] [--tokens 4608] [--heads 24] [--repeats 20]

Prints one JSON line per backend; cuDNN runs last, as an illegal memory access ends the process's CUDA context (one
process a layout).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _operands(args, contiguous: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shape = (args.batch, args.tokens, args.heads, 128)
    tensors = [torch.randn(shape, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
    if contiguous:
        tensors = [t.contiguous() for t in tensors]
    return [t.requires_grad_() for t in tensors]


def _pass(backend, q, k, v, grad) -> list[torch.Tensor]:
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in (q, k, v)]


def measure(args, name: str, contiguous: bool, reference: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    q, k, v = _operands(args, contiguous)
    grad = torch.randn_like(q.detach()).transpose(1, 2).contiguous().transpose(1, 2)  # as the backward brings it
    row = {"backend": name, "layout": "contiguous" if contiguous else "diffusers (transposed)",
           "tokens": args.tokens, "heads": args.heads, "batch": args.batch}
    try:
        for _ in range(3):
            for t in (q, k, v):
                t.grad = None
            results = _pass(BACKENDS[name], q, k, v, grad)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.repeats):
            for t in (q, k, v):
                t.grad = None
            results = _pass(BACKENDS[name], q, k, v, grad)
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - the bench reports what failed and goes on to the next backend
        print(json.dumps(dict(row, error=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")), flush=True)
        torch.cuda.synchronize()
        return None
    seconds = (time.perf_counter() - start) / args.repeats
    flops = 3.5 * 4 * args.batch * args.heads * args.tokens**2 * 128  # forward 4 b h s^2 d; backward 2.5x it
    row.update(ms=round(seconds * 1e3, 3), tflops=round(flops / seconds / 1e12, 1))
    if reference is not None:
        row["max_diff_to_flash"] = [round((a.float() - b.float()).abs().max().item(), 4)
                                    for a, b in zip(results, reference)]
    print(json.dumps(row), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4608, help="Flux.1-dev at 1024^2: 4096 picture + 512 text")
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layout", choices=["diffusers", "contiguous"], default="diffusers")
    args = parser.parse_args()
    contiguous = args.layout == "contiguous"
    reference = measure(args, "flash", contiguous, None)
    for name in ("efficient", "cudnn"):
        measure(args, name, contiguous, reference)


if __name__ == "__main__":
    main()
