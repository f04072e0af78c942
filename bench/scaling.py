"""Scaling over the GPUs of one host at one global batch: data parallel only, pipelines with several micro-batch
counts, pipeline x data parallel, and the parameter-count split against the planned one, each against one GPU.

    python bench/scaling.py --gpus 4 --profile                              # SDXL UNet, 1024x1024, bf16
    python bench/scaling.py --gpus 8 --config examples/sdxl_wide_unet.toml --only pipeline --stages 4,8 --profile
    python bench/scaling.py --gpus 2 --config examples/digits.toml --device cpu --batch 32 --steps 2   # gloo dry run
    python bench/scaling.py --gpus 2 --only pipeline --schedules 1f1b,interleaved_1f1b,zb1p,zbv,dualpipev --profile
    python bench/scaling.py --gpus 2 --only ddp,data,sharded --set observe.every=10 --rounds 2   # against torch DDP

On GPUs the planner is given the GPU's memory (`plan.memory_gib`, unless --set gives it) and, with --profile,
unit times measured on this GPU (`diffpipe plan --profile`, once, before the runs) instead of FLOP counts: on
two H200s the FLOP-counted split of the SDXL UNet gave stage 0 24 % more time per micro-batch than stage 1.

Every configuration is `diffpipe train` itself (it starts its processes: NCCL on GPUs, gloo on CPU) with the
same global batch, every step timed (`observe.every = 1`) and the timeline of step 3 drawn. Prints one JSON
line per configuration: samples/s, scaling efficiency (samples/s over GPUs x the one-GPU samples/s), measured
and ideal bubble, per-GPU peak memory beside the planner's, the timeline picture; then a markdown table of them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 3


def configurations(gpus: int, batch: int, micro: int, microbatch_counts: list[int], stage_counts: list[int],
                   only: set[str], schedules: tuple[str, ...] = ("1f1b",)) -> list[tuple[str, str, dict]]:
    """(kind, name, overrides) of every configuration asked for, the one-GPU baseline first."""
    out = []
    if "single" in only:
        out.append(("single", "1 GPU", {"pipeline.stages": 1, "pipeline.data_parallel": 1,
                                        "pipeline.microbatches": batch // micro}))
    if "data" in only and gpus > 1:
        out.append(("data", f"data parallel {gpus} (replicate)", {
            "pipeline.stages": 1, "pipeline.data_parallel": gpus, "pipeline.microbatches": max(1, batch // (micro * gpus))}))
    if "sharded" in only and gpus > 1:
        out.append(("sharded", f"data parallel {gpus} (fully_shard)", {
            "pipeline.stages": 1, "pipeline.data_parallel": gpus, "pipeline.data_parallel_shard": "true",
            "pipeline.microbatches": max(1, batch // (micro * gpus))}))
    for stages in stage_counts:
        if "pipeline" in only:
            for schedule in schedules:
                virtual = 1 if schedule in ("gpipe", "1f1b") else 2  # the others: 2 stages per GPU
                for m in microbatch_counts:
                    out.append(("pipeline", f"pipeline {stages}, {schedule}, {m} micro-batches",
                                {"pipeline.stages": stages, "pipeline.data_parallel": 1, "pipeline.microbatches": m,
                                 "pipeline.schedule": f'"{schedule}"', "pipeline.virtual_stages": virtual}))
        if "parameters" in only:
            m = batch // micro
            out.append(("parameters", f"pipeline {stages}, parameter-count split, {m} micro-batches",
                        {"pipeline.stages": stages, "pipeline.data_parallel": 1, "pipeline.microbatches": m,
                         "pipeline.split": '"parameters"'}))
    if "hybrid" in only and gpus >= 4 and gpus % 2 == 0:
        dp = gpus // 2
        out.append(("hybrid", f"pipeline 2 x data parallel {dp}",
                    {"pipeline.stages": 2, "pipeline.data_parallel": dp,
                     "pipeline.microbatches": max(2, batch // (micro * dp))}))
    return out


def run(config: str, name: str, overrides: dict, common: dict, extra: list[str], folder: Path) -> dict:
    """One `diffpipe train`; its figures from metrics.jsonl, or the error it stopped with."""
    cmd = [sys.executable, "-m", "diffpipe", "train", config, "--output-dir", str(folder), "--overwrite"]
    for key, value in {**common, **overrides}.items():
        cmd += ["--set", f"{key}={value}"]
    for item in extra:
        cmd += ["--set", item]
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    row = {"configuration": name, "overrides": overrides, "wall_s": round(time.perf_counter() - started, 1)}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "log.txt").write_text(result.stdout + result.stderr)  # the whole story of a failed row
    if result.returncode != 0:
        lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]  # the error last
        return {**row, "error": " ".join(lines[-3:])[-600:]}
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steady = rows[WARMUP:] or rows[-1:]
    step_s = statistics.median(r["step_time_s"] for r in steady)
    timed = [r for r in steady if "bubble_fraction" in r]
    peaks = {k: round(max(r[k] for r in timed if k in r), 2) for k in sorted({k for r in timed for k in r})
             if k.endswith("_peak_gib")}
    timeline = folder / "timeline.png"
    return {**row, "step_s": round(step_s, 4), "samples_per_s": round(common["train.batch_size"] / step_s, 3),
            "bubble": round(statistics.median(r["bubble_fraction"] for r in timed), 3) if timed else None,
            "ideal_bubble": round(timed[0]["ideal_bubble_fraction"], 3) if timed else None,
            "peak_gib_per_stage": peaks, "timeline": str(timeline) if timeline.exists() else None}


def planned_gib_per_gpu(config: str, overrides: dict, common: dict, extra: list[str]) -> list[float] | None:
    """The planner's peak memory for each GPU of a pipeline (its stages' sum), as the run plans it: to set beside
    the measured peaks. None when the configuration cannot be planned (the run then says why)."""
    from diffpipe.build import build_backbone
    from diffpipe.config_files import load_config
    from diffpipe.planner.plan import planned_figures, resolve_stages

    sets = [f"{key}={value}" for key, value in {**common, **overrides}.items()] + extra
    try:
        cfg = load_config(ROOT / config, sets)
        meta = build_backbone(cfg, "meta")
        starts, checkpointed = resolve_stages(cfg, meta)
        return [round(b / 2**30, 3) for b in planned_figures(cfg, meta, starts, checkpointed).process_memory_bytes]
    except Exception as exc:  # noqa: BLE001 - a bench row reports the run's own error instead
        print(f"planner: {overrides}: {exc}", file=sys.stderr)
        return None


def ddp_reference(gpus: int, batch: int, micro: int) -> dict:
    """torch DDP on the same GPUs and global batch (bench/reference/ddp_loop_gpu.py, SDXL UNet at 1024x1024)."""
    accumulation = max(1, batch // (micro * gpus))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           str(ROOT / "bench" / "reference" / "ddp_loop_gpu.py"), str(accumulation)]
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    row = {"configuration": f"torch DDP {gpus} (reference loop, {accumulation} accumulation steps of {micro})",
           "overrides": {}, "wall_s": round(time.perf_counter() - started, 1)}
    found = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not found:
        return {**row, "error": (result.stdout + result.stderr)[-600:]}
    return {**row, "step_s": found[0]["step_s"], "samples_per_s": found[0]["samples_per_s"], "bubble": None,
            "ideal_bubble": None, "peak_gib_per_stage": {"peak_gib": found[0]["peak_gib"]}, "timeline": None}


def planner_settings(config: str, device: str, batch: int, micro: int, profile: bool, out: Path,
                     extra: list[str]) -> dict:
    """What the planner is told about this machine: the GPU's memory, and its measured unit times (--profile)."""
    import torch

    given = {item.split("=", 1)[0] for item in extra}
    settings = {}
    if device != "cpu" and torch.cuda.is_available() and "plan.memory_gib" not in given:
        settings["plan.memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    if profile:
        path = (out / "unit_profile.json").resolve()
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "diffpipe", "plan", config, "--profile", "--set", f'plan.profile="{path}"',
               "--set", f"train.batch_size={batch}", "--set", f"pipeline.microbatches={batch // micro}",
               "--set", "pipeline.stages=1", "--set", f'train.device="{device}"']
        # planned, like the runs, for this GPU's memory (not the example's plan.memory_gib)
        for item in extra + [f"{key}={value}" for key, value in settings.items()]:
            cmd += ["--set", item]
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if result.returncode != 0:
            sys.exit(f"diffpipe plan --profile failed:\n{result.stderr[-2000:]}")
        settings["plan.profile"] = f'"{path}"'
    return settings


def table(rows: list[dict]) -> str:
    lines = ["| configuration | samples/s | efficiency | bubble (ideal) | peak GiB per GPU (planned) |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['configuration']} | failed: {r['error'][:120]} | | | |")
            continue
        bubble = "-" if r["bubble"] is None else f"{r['bubble']:.1%} ({r['ideal_bubble']:.1%})"
        eff = "-" if r.get("efficiency") is None else f"{r['efficiency']:.2f}"
        planned = r.get("planned_gib_per_gpu") or []
        peaks = ", ".join(f"{v:.1f}" + (f" ({planned[i]:.1f})" if i < len(planned) else "")
                          for i, v in enumerate(r["peak_gib_per_stage"].values()))
        lines.append(f"| {r['configuration']} | {r['samples_per_s']:.2f} | {eff} | {bubble} | {peaks} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, required=True, help="devices (GPUs, or CPU processes with --device cpu)")
    parser.add_argument("--config", default="examples/sdxl_unet.toml")
    parser.add_argument("--batch", type=int, default=64, help="global batch, the same in every configuration")
    parser.add_argument("--micro", type=int, default=8, help="micro-batch of the data-parallel and baseline runs")
    parser.add_argument("--microbatches", default="4,8,16", help="micro-batch counts of the pipeline runs")
    parser.add_argument("--schedules", default="1f1b", help="pipeline.schedule of the pipeline runs, comma-separated")
    parser.add_argument("--stages", default="", help="pipeline stage counts (default: --gpus)")
    parser.add_argument("--only", default="single,data,pipeline,parameters,hybrid",
                        help="of single, ddp (torch DDP reference loop, SDXL only), data, sharded (data parallel "
                             "on fully_shard), pipeline, parameters, hybrid")
    parser.add_argument("--steps", type=int, default=8, help="measured steps (after 3 warm-up steps)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", default="runs/scaling")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every configuration this many times, in turn (the lent GPUs' speed drifts by 5-15 %% "
                             "between calls and within one: compare rounds side by side)")
    parser.add_argument("--profile", action="store_true",
                        help="split by unit times measured on this device (diffpipe plan --profile), not FLOP counts")
    args = parser.parse_args()
    stage_counts = [int(s) for s in args.stages.split(",") if s] or [args.gpus]
    common = {"train.max_steps": args.steps + WARMUP, "train.batch_size": args.batch, "train.device": f'"{args.device}"',
              "pipeline.schedule": '"1f1b"', "pipeline.split": '"auto"', "pipeline.checkpointing": '"auto"',
              "observe.every": 1, "observe.timeline_step": WARMUP, "observe.log_every": 0,
              "output.save_weights": "false", "output.sample_every_end": "false"}
    common.update(planner_settings(args.config, args.device, args.batch, args.micro, args.profile, Path(args.out),
                                   args.set))
    print(json.dumps({"planner": common}), flush=True)
    rows, baseline = [], None
    chosen = configurations(args.gpus, args.batch, args.micro, [int(m) for m in args.microbatches.split(",") if m],
                            stage_counts, set(args.only.split(",")), tuple(args.schedules.split(",")))
    for round_ in range(args.rounds):
        if "ddp" in args.only.split(",") and args.gpus > 1:
            rows.append({**ddp_reference(args.gpus, args.batch, args.micro), "devices": args.gpus, "round": round_})
            print(json.dumps(rows[-1]), flush=True)
        for index, (kind, name, overrides) in enumerate(chosen):
            row = run(args.config, name, overrides, common, args.set, Path(args.out) / f"{index:02d}-{kind}")
            if "error" not in row:
                row["planned_gib_per_gpu"] = planned_gib_per_gpu(args.config, overrides, common, args.set)
            devices = overrides["pipeline.stages"] * overrides["pipeline.data_parallel"]
            if kind == "single" and "error" not in row:
                baseline = row["samples_per_s"]
            if baseline and "error" not in row:
                row["efficiency"] = round(row["samples_per_s"] / (devices * baseline), 3)
            row.update(devices=devices, round=round_)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(table(rows), flush=True)


if __name__ == "__main__":
    main()
