"""Attention at the Wan 14B slice's shapes in fp8 against bf16 (issue 54: the Wan goal, 1.2x the plain loop, is bounded
by attention, which both loops run on cuDNN's bf16 kernels): forward + backward time of torch's cuDNN kernels in bf16
and of cuDNN's fp8 kernels through NVIDIA's cudnn-frontend (`pip install nvidia-cudnn-frontend`; torch 2.11's SDPA
has no fp8), the fp8 path's casts and scales included, and each path's error against an fp32 reference.

    python bench/fp8_attention.py [--tokens 32760] [--heads 40] [--repeats 10] [--sharpness 1]

Prints one JSON line per path, then the kernels' agreement with diffpipe's written-out arithmetic at a small size.
The fp8 path is diffpipe's `attend_fp8` (models/fp8_attention.py: its scales are described there), its first
backward calibrating the delayed scales before the timed passes. Random operands (q, k, v ~ N(0, 1), q times
--sharpness): at 1 a flatter softmax than a trained model's; a larger sharpness makes a few keys take most of each
row, as trained attention does.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffpipe.models.fp8_attention import attend_fp8


def _operands(args) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    shape = (args.batch, args.heads, args.tokens, args.head_dim)
    qkv = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    qkv[0] *= args.sharpness
    return qkv, torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 1e-3


def _reference(qkv, grad) -> list[torch.Tensor]:
    """Output and gradients in fp32 (the memory-efficient kernel: flash and cuDNN take no fp32)."""
    inputs = [t.float().requires_grad_() for t in qkv]
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = F.scaled_dot_product_attention(*inputs)
    out.backward(grad.float())
    return [out.detach()] + [t.grad for t in inputs]


def _pass(attend, qkv, grad) -> list[torch.Tensor]:
    """One forward and backward of `attend(q, k, v)`: the output and the three gradients."""
    inputs = [t.detach().requires_grad_() for t in qkv]
    out = attend(*inputs)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in inputs]


def _bf16_cudnn(q, k, v) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v)


def _kernels_against_reference(heads: int = 4, tokens: int = 1024, head_dim: int = 128) -> dict:
    """cuDNN's fp8 kernels against diffpipe's written-out arithmetic (models/fp8_attention.py's `_reference_*`,
    run on the GPU from the same fp8 operands) at a size whose whole score matrix fits: each of output, dq, dk, dv
    as |kernel - reference| / |reference|, and the backward's maxima from each."""
    from diffpipe.models import fp8_attention as fp8

    torch.manual_seed(1)
    shape = (1, heads, tokens, head_dim)
    qkv = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) * s for s in (3.0, 1.0, 1.0)]
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 1e-3
    scale = head_dim ** -0.5
    out, q8, k8, v8, o8, stats, descales = fp8._forward(*qkv, scale)
    o8_ref, stats_ref = fp8._reference_forward(q8, k8, v8, descales, scale)
    grad8, descale_grad = fp8.quantised(grad)
    descales = torch.cat([descales, descale_grad.reshape(1)])
    delayed = torch.ones(4, device="cuda")
    for _ in range(3):  # the scales the op would settle on (its calibration), from the written-out arithmetic
        delayed = fp8._delayed(fp8._reference_backward(grad8, q8, k8, v8, o8, stats, descales, delayed, scale)[1])
    kernel, kernel_maxima = fp8._run_backward(grad8, q8, k8, v8, o8, stats, descales, delayed, scale)
    reference, reference_maxima = fp8._reference_backward(grad8, q8, k8, v8, o8, stats, descales, delayed, scale)
    return {"out": _gap(o8, o8_ref), "log_sum_exp": _gap(stats, stats_ref),
            **_gaps(kernel, reference, ("dq", "dk", "dv")),
            "maxima_kernel": [float(f"{m:.4g}") for m in kernel_maxima.tolist()],
            "maxima_reference": [float(f"{m:.4g}") for m in reference_maxima.tolist()]}


def _gap(result: torch.Tensor, reference: torch.Tensor) -> float:
    """|result - reference| / |reference| (Frobenius norms)."""
    return round(((result.float() - reference.float()).norm() / reference.float().norm()).item(), 5)


def _gaps(results, references, names=("out", "dq", "dk", "dv")) -> dict:
    return {name: _gap(r, ref) for name, r, ref in zip(names, results, references)}


def _timed(run, repeats: int) -> tuple[float, list[torch.Tensor]]:
    for _ in range(2):
        results = run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        results = run()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats, results




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32760, help="Wan at 480x832 x 81 frames: 21 x 30 x 52")
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sharpness", type=float, default=1.0, help="q's scale: larger, a peakier softmax")
    args = parser.parse_args()
    qkv, grad = _operands(args)
    reference = _reference(qkv, grad)
    flops = 3.5 * 4 * args.batch * args.heads * args.tokens**2 * args.head_dim  # backward 2.5x the forward
    row = {"tokens": args.tokens, "heads": args.heads, "head_dim": args.head_dim, "sharpness": args.sharpness,
           "device": torch.cuda.get_device_name()}
    seconds, results = _timed(lambda: _pass(_bf16_cudnn, qkv, grad), args.repeats)
    print(json.dumps(dict(row, path="bf16, torch's cuDNN kernels", ms=round(seconds * 1e3, 2),
                          tflops=round(flops / seconds / 1e12, 1), error=_gaps(results, reference))), flush=True)
    try:
        import cudnn

        maxima = torch.zeros(4, device="cuda")
        def fp8(q, k, v):
            return attend_fp8(q, k, v, maxima)

        _pass(fp8, qkv, grad)  # its first backward calibrates the delayed scales
        seconds, results = _timed(lambda: _pass(fp8, qkv, grad), args.repeats)
        print(json.dumps(dict(row, path=f"fp8 (diffpipe's attend_fp8), cuDNN {cudnn.backend_version()} via "
                              f"cudnn-frontend {cudnn.__version__}, casts included", ms=round(seconds * 1e3, 2),
                              tflops=round(flops / seconds / 1e12, 1), error=_gaps(results, reference))),
              flush=True)
        print(json.dumps({"kernels against the written-out arithmetic": _kernels_against_reference()}), flush=True)
    except Exception as error:  # noqa: BLE001 - the bench says what failed
        print(json.dumps(dict(row, path="fp8", error=f"{type(error).__name__}: {str(error)[:600]}")), flush=True)


if __name__ == "__main__":
    main()
