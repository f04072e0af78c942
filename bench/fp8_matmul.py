"""fp8 against bf16 for the matmuls of a frozen base's linear layers (issue 54's first question): a LoRA run's base
computes its forward (x @ W.T) and its input gradient (g @ W); with fp8 compute both run as `torch._scaled_mm` with
rowwise scales (the activation or gradient quantised per row on each call, the frozen weight once, per output row for
the forward and per input column for the input gradient). Times each, with the per-call quantisation included, and
the fp8 result's error against bf16's, for Flux.1-dev's and Wan 14B's linear shapes.

    python bench/fp8_matmul.py                       # a GPU with fp8 (Ada, Hopper, Blackwell)
    python bench/fp8_matmul.py --device cpu --tokens 64 --repeats 2 --modes eager alone     # a smoke run

Three ways of running the fp8 side (`--modes`): "eager" quantises the activation in separate eager kernels on every
call; "alone" times `_scaled_mm` on an operand quantised beforehand (what fp8's tensor cores give when quantising
costs nothing); "compiled" is the eager function under torch.compile, which fuses the quantisation into one
reduction kernel ahead of the matmul (what a compiled block gets).

Prints one JSON line per shape and mode: bf16 and fp8 milliseconds and TFLOP/s for the forward and the input
gradient, their speed-up, and the relative error of fp8's output (|fp8 - bf16| / |bf16|, Frobenius).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# (name, in features, out features): Flux.1-dev's attention and MLP projections, Wan 14B's
SHAPES = [("flux qkv/out", 3072, 3072), ("flux mlp up", 3072, 12288), ("flux mlp down", 12288, 3072),
          ("wan qkv/out", 5120, 5120), ("wan ffn up", 5120, 13824), ("wan ffn down", 13824, 5120)]


def rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) as fp8 with one scale per row: (x / scale in fp8, scale (M, 1) in fp32)."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).to(FP8), scale


def fp8_matmul(a: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """a (M, K) in bf16 @ b (K, N) given as b_t (N, K) in fp8 with scales (1, N): a quantised per row on the call."""
    a8, a_scale = rowwise(a)
    return torch._scaled_mm(a8, b_t.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median milliseconds of `fn()` over `repeats` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def fp8_matmul_alone(a8: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor):
    """The fp8 matmul on an operand already quantised."""
    return torch._scaled_mm(a8, b_t.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)


def fp8_side(mode: str, a: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor):
    """The callable a mode times for a @ b."""
    if mode == "eager":
        return lambda: fp8_matmul(a, b_t, b_scale)
    if mode == "alone":
        a8, a_scale = rowwise(a)
        return lambda: fp8_matmul_alone(a8, a_scale, b_t, b_scale)
    compiled = torch.compile(fp8_matmul)
    return lambda: compiled(a, b_t, b_scale)


def measure(name: str, k: int, n: int, tokens: int, repeats: int, device: torch.device, mode: str) -> dict:
    torch.manual_seed(0)
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
    grad = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
    w_rows, w_row_scale = rowwise(weight)  # per output row: the forward's b = W.T, column-major
    w_cols, w_col_scale = rowwise(weight.t().contiguous())  # per input column: the input gradient's b = W
    flops = 2 * tokens * k * n
    figures = {"shape": name, "mode": mode, "tokens": tokens, "in": k, "out": n}
    for step, bf16, fp8 in (
            ("forward", lambda: x @ weight.t(), fp8_side(mode, x, w_rows, w_row_scale.t())),
            ("input_grad", lambda: grad @ weight, fp8_side(mode, grad, w_cols, w_col_scale.t()))):
        ms_bf16, ms_fp8 = timed(bf16, repeats, device), timed(fp8, repeats, device)
        exact, approx = bf16().float(), fp8().float()
        figures.update({f"{step}_bf16_ms": round(ms_bf16, 4), f"{step}_fp8_ms": round(ms_fp8, 4),
                        f"{step}_bf16_tflops": round(flops / ms_bf16 / 1e9, 1),
                        f"{step}_fp8_tflops": round(flops / ms_fp8 / 1e9, 1),
                        f"{step}_speedup": round(ms_bf16 / ms_fp8, 3),
                        f"{step}_rel_error": round(float((approx - exact).norm() / exact.norm()), 5)})
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4608, help="rows: a 1024^2 Flux image's 4096 + 512 text")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", nargs="+", choices=("eager", "alone", "compiled"),
                        default=["eager", "alone", "compiled"])
    args = parser.parse_args()
    device = torch.device(args.device)
    print(json.dumps({"torch": torch.__version__,
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}), flush=True)
    for mode in args.modes:
        for name, k, n in SHAPES:
            print(json.dumps(measure(name, k, n, args.tokens, args.repeats, device, mode)), flush=True)


if __name__ == "__main__":
    main()
