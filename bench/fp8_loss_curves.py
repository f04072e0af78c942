"""Does fp8 compute change how a Flux.1-dev-size LoRA trains (issue 54's quality goal)? The same LoRA run twice on
the photos folder, same seed (same batches, noise and timesteps): a bf16 base, and an fp8 base whose products are
fp8 (`train.fp8_compute`); prints the bf16 run's step-to-step spread (the mean |loss[t] - loss[t-1]|), the mean and
largest |fp8 loss - bf16 loss| at each step, and the 20-step means of both curves; writes both curves as JSON.

    python bench/write_flux_folder.py --out /tmp/flux_dev --double 19 --single 38 --t5-layers 2 --photos
    python bench/fp8_loss_curves.py --model /tmp/flux_dev [--steps 200] [--resolution 512] [--out curves.json]

Random weights (the folder bench/write_flux_folder.py writes, Flux.1-dev's widths), real photographs; one GPU,
`pipeline.compile = "blocks"`, the recipe examples/flux_lora.toml otherwise (LoRA r16 on the attention projections).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPE = Path(__file__).resolve().parent.parent / "examples" / "flux_lora.toml"
RUNS = {"bf16": ['memory.base_dtype="bf16"', "train.fp8_compute=false"],
        "fp8 compute": ['memory.base_dtype="fp8"', "train.fp8_compute=true"]}


def losses(model: Path, data: Path, sets: list[str], steps: int, resolution: int, run: Path) -> list[float]:
    """The run's loss at each step (metrics.jsonl); its stderr's end if it fails."""
    sets = [f'model.path="{model}"', f'data.path="{data}"', f"data.resolution={resolution}",
            f"train.max_steps={steps}", 'pipeline.compile="blocks"', "memory.block_swap=0",
            'pipeline.checkpointing="none"', "plan.memory_gib=1000", "output.sample_every_end=false",
            "output.save_weights=false", "checkpoint.every=0", "checkpoint.export_every=0", "sample.every=0",
            "observe.log_every=0", *sets]
    command = [sys.executable, "-m", "diffpipe", "train", str(RECIPE), "--output-dir", str(run), "--overwrite",
               *(x for s in sets for x in ("--set", s))]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def window_means(curve: list[float], width: int = 20) -> list[float]:
    return [statistics.fmean(curve[i:i + width]) for i in range(0, len(curve), width)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a Flux folder with photos/ (write_flux_folder.py)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--data", type=Path, default=None, help="the images (default: the model folder's photos/)")
    parser.add_argument("--out", type=Path, default=None, help="write both curves here as JSON")
    parser.add_argument("--set", action="append", default=[], help="another config override for both runs")
    args = parser.parse_args()
    data = args.data or args.model / "photos"
    with tempfile.TemporaryDirectory() as folder:
        curves = {name: losses(args.model, data, sets + args.set, args.steps, args.resolution,
                               Path(folder) / name.replace(" ", "_"))
                  for name, sets in RUNS.items()}
    if args.out:
        args.out.write_text(json.dumps(curves))
    reference, fp8 = curves["bf16"], curves["fp8 compute"]
    spread = statistics.fmean(abs(b - a) for a, b in zip(reference, reference[1:]))
    diffs = [abs(a - b) for a, b in zip(fp8, reference)]
    print(json.dumps({"steps": len(reference), "bf16_step_to_step_spread": round(spread, 5),
                      "mean_abs_diff": round(statistics.fmean(diffs), 5), "max_abs_diff": round(max(diffs), 5),
                      "mean_diff_over_spread": round(statistics.fmean(diffs) / spread, 4),
                      "bf16_20_step_means": [round(x, 4) for x in window_means(reference)],
                      "fp8_20_step_means": [round(x, 4) for x in window_means(fp8)]}), flush=True)


if __name__ == "__main__":
    main()
