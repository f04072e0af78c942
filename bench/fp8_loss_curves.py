"""Does fp8 compute change how a Flux.1-dev-size LoRA trains (issue 54's quality goal)? The same LoRA run twice on
the photos folder, same seed (same batches, noise and timesteps): a bf16 base, and an fp8 base whose products are
fp8 (`train.fp8_compute`); prints the bf16 run's step-to-step spread (the mean |loss[t] - loss[t-1]|), the mean and
largest |fp8 loss - bf16 loss| at each step, and the 20-step means of both curves; writes both curves as JSON.
The two runs train at once on the one GPU (Flux.1-dev's 12 B in bf16 and in fp8 fit an 80 GB card together), so
loading, caching and compiling overlap; each run's folder (its log and metrics.jsonl) is kept under --runs, so a run
cut off by a time limit still shows how far it got.

    python bench/write_flux_folder.py --out /tmp/flux_dev --double 19 --single 38 --t5-layers 2 --photos
    python bench/fp8_loss_curves.py --model /tmp/flux_dev [--steps 200] [--resolution 512] [--out curves.json]
        [--runs runs/curves]

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
from contextlib import ExitStack
from pathlib import Path

RECIPE = Path(__file__).resolve().parent.parent / "examples" / "flux_lora.toml"
RUNS = {"bf16": ['memory.base_dtype="bf16"', "train.fp8_compute=false"],
        "fp8 compute": ['memory.base_dtype="fp8"', "train.fp8_compute=true"]}


def start(model: Path, data: Path, sets: list[str], steps: int, resolution: int, run: Path) -> subprocess.Popen:
    """Start one training run in `run`, its output going to `run`.log beside it as it comes."""
    sets = [f'model.path="{model}"', f'data.path="{data}"', f"data.resolution={resolution}",
            f"train.max_steps={steps}", 'pipeline.compile="blocks"', "memory.block_swap=0",
            'pipeline.checkpointing="none"', "plan.memory_gib=1000", "output.sample_every_end=false",
            "output.save_weights=false", "checkpoint.every=0", "checkpoint.export_every=0", "sample.every=0",
            "observe.log_every=0", *sets]
    command = [sys.executable, "-m", "diffpipe", "train", str(RECIPE), "--output-dir", str(run), "--overwrite",
               *(x for s in sets for x in ("--set", s))]
    run.parent.mkdir(parents=True, exist_ok=True)
    with open(run.parent / f"{run.name}.log", "w") as log:  # beside the run: --overwrite empties the run folder
        print(" ".join(command), file=log, flush=True)
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)  # the run keeps its own handle


def losses(running: subprocess.Popen, run: Path) -> list[float]:
    """The run's loss at each step (metrics.jsonl) once it ends; its log's end if it fails."""
    if running.wait() != 0:
        log = (run.parent / f"{run.name}.log").read_text()
        raise SystemExit(f"{' '.join(running.args)} failed:\n{log[-3000:]}")
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
    parser.add_argument("--runs", type=Path, default=None, help="keep the runs' folders and logs here")
    args = parser.parse_args()
    data = args.data or args.model / "photos"
    with ExitStack() as stack:
        folder = args.runs or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        runs = {name: folder / name.replace(" ", "_") for name in RUNS}
        running = {name: start(args.model, data, sets + args.set, args.steps, args.resolution, runs[name])
                   for name, sets in RUNS.items()}
        stack.callback(lambda: [r.kill() for r in running.values() if r.poll() is None])
        curves = {name: losses(running[name], runs[name]) for name in RUNS}
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
