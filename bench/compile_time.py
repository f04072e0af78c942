"""How long `pipeline.compile` takes to compile, and the step it gives: eager, the whole stage (`true`) and only
the repeated blocks (`"blocks"`), each in a fresh process with an empty inductor cache. One stage holding a
whole SDXL-style UNet (small widths, `--layers` transformer layers per level), forward+backward; prints one
JSON line per mode.

    python bench/compile_time.py [--modes eager,stage,blocks] [--layers 1,2,6] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(mode: str, layers: tuple[int, ...], device: str) -> dict:
    """Runs in the child process: first step (compiling) and median of 5 steps after it."""
    import torch
    from diffusers import UNet2DConditionModel

    sys.path.insert(0, str(ROOT))
    from diffpipe.models.families.unet.unet2d import unet_backbone
    from diffpipe.pipeline.split import stage_specs
    from diffpipe.pipeline.stage import build_stage_modules
    from tests.models.test_unet_units import SDXL_STYLE, _inputs

    torch.manual_seed(0)
    config = dict(SDXL_STYLE, transformer_layers_per_block=layers)
    backbone = unet_backbone(UNet2DConditionModel(**config).train())
    compiled = {"eager": False, "stage": True, "blocks": "blocks"}[mode]
    stage = build_stage_modules(backbone, stage_specs(backbone, []), compiled=compiled)[0].to(device)
    sample, conditions = _inputs(config)
    sample, conditions = sample.to(device), {k: v.to(device) for k, v in conditions.items()}

    def step() -> float:
        start = time.perf_counter()
        stage(sample, **conditions).float().pow(2).mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    first = step()
    steps = sorted(step() for _ in range(5))
    return {"mode": mode, "layers": list(layers), "device": device, "first_step_s": round(first, 1),
            "step_ms": round(steps[2] * 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="eager,stage,blocks")
    parser.add_argument("--layers", default="1,2,6")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    layers = tuple(int(n) for n in args.layers.split(","))
    if args.child:
        print(json.dumps(measure(args.child, layers, args.device)), flush=True)
        return
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as cache:
            result = subprocess.run([sys.executable, __file__, "--child", mode, "--layers", args.layers,
                                     "--device", args.device], capture_output=True, text=True,
                                    env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        print(lines[-1] if lines else json.dumps({"mode": mode, "error": result.stderr[-800:]}), flush=True)


if __name__ == "__main__":
    main()
