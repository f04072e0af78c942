"""diffpipe on the torch installed here, as a user runs it: the suite's torch_smoke subset, the SDXL plan, the digits
main job and an SDXL run whose split and checkpointing the planner chooses. Prints one JSON line per command (exit
code, wall time, and the figures each prints) and writes each command's output under --out.

    python bench/torch_smoke.py --out smoke-logs             # a GPU machine: digits and SDXL on CUDA
    python bench/torch_smoke.py --out smoke-logs --only tests plan
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SDXL = ["examples/sdxl_unet.toml", "--set", "pipeline.stages=1", "--set", "pipeline.microbatches=1",
        "--set", "train.max_steps=12", "--set", "observe.every=1", "--set", "output.save_weights=false",
        "--set", "train.device=\"cuda\""]


def _commands(out: Path) -> dict[str, list[str]]:
    py = [sys.executable]
    return {
        "tests": py + ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "torch_smoke", "-x"],
        "plan": py + ["-m", "diffpipe", "plan", "examples/sdxl_unet.toml"],
        "digits": py + ["-m", "diffpipe", "train", "examples/digits.toml", "--set", "train.device=\"cuda\"",
                        "--output-dir", str(out / "digits"), "--overwrite"],
        "digits-one-stage": py + ["-m", "diffpipe", "train", "examples/digits.toml", "--set",
                                  "train.device=\"cuda\"", "--set", "pipeline.stages=1",
                                  "--output-dir", str(out / "digits-one-stage"), "--overwrite"],
        # a V-shaped zero-bubble schedule (NCCL sends between a process's own stages; gloo before torch 2.13 cannot)
        "digits-zbv": py + ["-m", "diffpipe", "train", "examples/digits.toml", "--set", "pipeline.schedule=\"zbv\"",
                            "--set", "pipeline.virtual_stages=2",
                            "--set", "train.max_steps=60", "--output-dir", str(out / "digits-zbv"), "--overwrite"],
        # a LoRA on an fp8 base whose last 2 units swap: the end-of-run merge read their weights from host memory
        # beside scales on the GPU and failed after training (issue 58); it must end with its weights written
        "digits-lora-fp8-swap": py + ["-m", "diffpipe", "train", "examples/digits_lora.toml", "--set",
                                      "train.device=\"cuda\"", "--set", "pipeline.stages=1", "--set",
                                      "train.max_steps=30", "--set", "memory.block_swap=2", "--set",
                                      "train.precision=\"bf16\"", "--set", "memory.base_dtype=\"fp8\"",
                                      "--output-dir", str(out / "digits-lora-fp8-swap"), "--overwrite"],
        # the digits LoRA with its base's linear products in fp8 (issue 54): the whole job, for its quality check
        "digits-lora-fp8-compute": py + ["-m", "diffpipe", "train", "examples/digits_lora.toml", "--set",
                                         "train.device=\"cuda\"", "--set", "pipeline.stages=1", "--set",
                                         "train.precision=\"bf16\"", "--set", "train.fp8_compute=true",
                                         "--output-dir", str(out / "digits-lora-fp8-compute"), "--overwrite"],
        # the planner checkpoints the stage where 70 GiB would not hold its activations (planned 47.8 GiB)
        "sdxl-auto-70gib": py + ["-m", "diffpipe", "train", *SDXL, "--set", "plan.memory_gib=70",
                                 "--output-dir", str(out / "sdxl-70"), "--overwrite"],
        "sdxl-auto-139gib": py + ["-m", "diffpipe", "train", *SDXL, "--set", "plan.memory_gib=139",
                                  "--output-dir", str(out / "sdxl-139"), "--overwrite"],
    }


def _figures(name: str, out: Path, text: str) -> dict:
    """What each command's output and run folder say: losses, speed and peak memory of the steps after the first."""
    run = {"digits": "digits", "digits-one-stage": "digits-one-stage", "digits-zbv": "digits-zbv",
           "digits-lora-fp8-swap": "digits-lora-fp8-swap", "digits-lora-fp8-compute": "digits-lora-fp8-compute",
           "sdxl-auto-70gib": "sdxl-70",
           "sdxl-auto-139gib": "sdxl-139"}.get(name)
    figures = {}
    if run and (out / run / "metrics.jsonl").is_file():
        rows = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
        later = rows[2:] or rows
        figures.update(steps=len(rows), first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"],
                       samples_per_s=sum(r["samples_per_s"] for r in later) / len(later),
                       peak_gib=max((v for r in rows for k, v in r.items() if k.endswith("_peak_gib")), default=None))
    for line in text.splitlines():
        if line.startswith(("planned split", "  slowest stage", "training ", "done:")) or "passed" in line:
            figures.setdefault("lines", []).append(line.strip())
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="each command's output, as NAME.log")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/diffpipe-smoke-runs"), help="the run folders")
    parser.add_argument("--only", nargs="*", help="run only these commands")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.runs.mkdir(parents=True, exist_ok=True)
    import torch

    print(json.dumps({"torch": torch.__version__, "python": sys.version.split()[0],
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}), flush=True)
    codes: dict[str, int] = {}
    for name, cmd in _commands(args.runs).items():
        if args.only and name not in args.only:
            continue
        if name == "digits-one-stage" and not args.only and codes.get("digits") == 0:
            continue  # only needed where two processes cannot share the one GPU
        start = time.perf_counter()
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ})
        codes[name] = result.returncode
        text = result.stdout + result.stderr
        (args.out / f"{name}.log").write_text(text)
        print(json.dumps({"command": name, "rc": result.returncode, "wall_s": round(time.perf_counter() - start, 1),
                          **_figures(name, args.runs, text), "tail": text.strip().splitlines()[-1:]}), flush=True)


if __name__ == "__main__":
    main()
