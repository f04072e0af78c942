"""Where fp8 compute's time goes inside a compiled block (issue 54): a stack of Flux.1-dev single-block-shaped layers
(to_q, to_k, to_v 3072 -> 3072, proj_mlp 3072 -> 12288, proj_out 15360 -> 3072, the modulation's 3072 -> 9216 on one
row), attention left out (q * k + v stands in, so every product's input gradient is needed), each block compiled
as `pipeline.compile = "blocks"` compiles it, forward and backward of the input alone (a LoRA's frozen base). Times
each way of running the frozen products, in the same process:

- `bf16`: the weights in bf16, `F.linear` (the plain loop's base);
- `fp8`: diffpipe's `Fp8Product` as it runs (the weight's column-major copy made in each backward);
- `fp8-kept-transpose`: the same with the column-major copy made once and kept (one more byte a weight);
- `fp8-forward-only`: the forward on fp8 tensor cores, the input gradient in bf16 from the stored weight.

    python bench/fp8_block.py [--blocks 8] [--tokens 4608] [--repeats 10] [--top 15]
    python bench/fp8_block.py --device cpu --blocks 1 --tokens 64 --width 256 --repeats 1 --eager   # a smoke run

Prints one JSON line per way: the median milliseconds of one block's forward and backward, its speed-up over bf16,
and the peak memory.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffpipe.models.stored_linear import Fp8Product, fp8_forward, quantise  # noqa: E402
from diffpipe.torch_support import scaled_matmul  # noqa: E402


class KeptTranspose(torch.autograd.Function):
    """`Fp8Product` with the weight's column-major copy given, not made in backward."""

    @staticmethod
    def forward(ctx, x, stored, stored_columns, scale, dtype):
        ctx.save_for_backward(stored_columns, scale)
        return fp8_forward(x, stored, scale, dtype)

    @staticmethod
    def backward(ctx, grad):
        stored_columns, scale = ctx.saved_tensors
        g8, g_scale = quantise(grad.reshape(-1, grad.shape[-1]).float() * scale.view(1, -1))
        columns = torch.ones(1, stored_columns.shape[0], device=grad.device)
        dx = scaled_matmul(g8, stored_columns.t(), g_scale, columns, grad.dtype)
        return dx.view(*grad.shape[:-1], stored_columns.shape[0]), None, None, None, None


class ForwardOnly(torch.autograd.Function):
    """The forward on fp8 tensor cores; the input gradient as fp8 storage computes it (bf16)."""

    @staticmethod
    def forward(ctx, x, stored, scale, dtype):
        ctx.save_for_backward(stored, scale)
        return fp8_forward(x, stored, scale, dtype)

    @staticmethod
    def backward(ctx, grad):
        stored, scale = ctx.saved_tensors
        return (grad * scale.view(-1).to(grad.dtype)).matmul(stored.to(grad.dtype)), None, None, None  # ScaledProduct's


class Frozen(nn.Module):
    """A frozen linear layer run one of the ways."""

    def __init__(self, inputs: int, outputs: int, way: str, device: torch.device):
        super().__init__()
        weight = torch.randn(outputs, inputs, device=device) / inputs**0.5
        self.way = way
        if way == "bf16":
            self.register_buffer("weight", weight.bfloat16())
            return
        stored, scale = quantise(weight)
        self.register_buffer("stored", stored)
        self.register_buffer("scale", scale)
        if way == "fp8-kept-transpose":
            self.register_buffer("stored_columns", stored.t().contiguous())

    def forward(self, x):
        if self.way == "bf16":
            return F.linear(x, self.weight)
        if self.way == "fp8":
            return Fp8Product.apply(x, self.stored, self.scale, None, torch.bfloat16)
        if self.way == "fp8-kept-transpose":
            return KeptTranspose.apply(x, self.stored, self.stored_columns, self.scale, torch.bfloat16)
        return ForwardOnly.apply(x, self.stored, self.scale, torch.bfloat16)


class Block(nn.Module):
    """A Flux single block's products, attention replaced by q * k + v."""

    def __init__(self, width: int, way: str, device: torch.device):
        super().__init__()
        self.modulation = Frozen(width, 3 * width, way, device)
        self.q, self.k, self.v = (Frozen(width, width, way, device) for _ in range(3))
        self.mlp = Frozen(width, 4 * width, way, device)
        self.out = Frozen(5 * width, width, way, device)

    def forward(self, x, temb):
        shift, scale, gate = self.modulation(F.silu(temb)).chunk(3, dim=-1)
        h = F.layer_norm(x, x.shape[-1:]) * (1 + scale) + shift
        attention = self.q(h) * self.k(h) + self.v(h)
        return x + gate * self.out(torch.cat([attention, F.gelu(self.mlp(h), approximate="tanh")], dim=-1))


def measure(way: str, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    blocks = [Block(args.width, way, device) for _ in range(args.blocks)]
    if not args.eager:
        blocks = [torch.compile(block, fullgraph=True) for block in blocks]
    x0 = torch.randn(1, args.tokens, args.width, device=device, dtype=torch.bfloat16, requires_grad=True)
    temb = torch.randn(1, 1, args.width, device=device, dtype=torch.bfloat16, requires_grad=True)

    def step():
        x = x0
        for block in blocks:
            x = block(x, temb)
        x.float().square().mean().backward()

    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3 / args.blocks)
    if args.top:
        figures_kernels = kernels(step, args.top, args.blocks, device)
    figures = {"way": way, "block_ms": round(sorted(times)[len(times) // 2], 4), "blocks": args.blocks,
               "tokens": args.tokens, "width": args.width}
    if args.top:
        figures["top_kernels_us_per_block"] = figures_kernels
    if device.type == "cuda":
        figures["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return figures


def kernels(step, top: int, blocks: int, device: torch.device) -> list:
    """The `top` kernels by device time over two steps under torch.profiler: (name, microseconds a block)."""
    from torch.profiler import ProfilerActivity, profile
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(2):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    attribute = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda row: getattr(row, attribute), reverse=True)[:top]
    return [(row.key[:90], round(getattr(row, attribute) / 2 / blocks, 1)) for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4608, help="rows: a 1024^2 Flux image's 4096 + 512 text")
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=0, help="also list the kernels taking the most time")
    parser.add_argument("--eager", action="store_true", help="do not compile the blocks")
    parser.add_argument("--ways", nargs="+", default=["bf16", "fp8", "fp8-kept-transpose", "fp8-forward-only"])
    args = parser.parse_args()
    device = torch.device(args.device)
    print(json.dumps({"torch": torch.__version__,
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}), flush=True)
    base = None
    for way in args.ways:
        figures = measure(way, args, device)
        base = base or figures["block_ms"]
        figures["speedup_over_first"] = round(base / figures["block_ms"], 3)
        print(json.dumps(figures), flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
