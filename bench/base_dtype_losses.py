"""How much a quantised LoRA base changes training (issue 33): the same LoRA run, one stage, bf16 autocast, for N
steps with memory.base_dtype = bf16, fp8, int8 and nf4 on the tiny Flux, SDXL and Wan examples; prints per example
and base the mean and largest |loss - bf16's loss| over the steps, relative to bf16's mean loss, and the last loss.
The same seed gives every run the same batches, noise and timesteps: what differs is the base's weights alone.

    python examples/make_tiny_pipeline.py && python bench/base_dtype_losses.py --steps 50 [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUNS = {"flux": "flux_tiny.toml", "sdxl": "photos.toml", "wan": "wan_clips.toml"}
BASES = ["bf16", "fp8", "int8", "nf4"]


def losses(example: str, base: str, steps: int, device: str, run: Path) -> list[float]:
    sets = ["pipeline.stages=1", 'adapter.type="lora"', 'train.precision="bf16"', f'memory.base_dtype="{base}"',
            f"train.max_steps={steps}", f'train.device="{device}"', "output.sample_every_end=false",
            "output.save_weights=false", "checkpoint.every=0", "observe.log_every=0", "train.warmup_steps=0"]
    command = [sys.executable, "-m", "diffpipe", "train", str(EXAMPLES / example), "--output-dir", str(run),
               "--overwrite", *(x for s in sets for x in ("--set", s))]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{example} with base {base} failed:\n{done.stderr[-2000:]}")
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--examples", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()
    print(f"{'example':8} {'base':5} {'mean |diff| / mean loss':>24} {'max |diff| / mean loss':>23} {'last loss':>10}")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.examples:
            curves = {base: losses(RUNS[name], base, args.steps, args.device, Path(folder) / f"{name}-{base}")
                      for base in BASES}
            reference = curves["bf16"]
            scale = sum(reference) / len(reference)
            for base, curve in curves.items():
                diffs = [abs(a - b) for a, b in zip(curve, reference)]
                print(f"{name:8} {base:5} {sum(diffs) / len(diffs) / scale:24.5f} {max(diffs) / scale:23.5f} "
                      f"{curve[-1]:10.4f}", flush=True)


if __name__ == "__main__":
    main()
