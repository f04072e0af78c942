"""diffpipe against the plain training loop on one GPU: SDXL-config UNet (random weights), 1024x1024, fp32
weights, bf16 autocast, fused AdamW, full fine-tune. Prints one JSON line per configuration.

    python bench/sdxl_one_gpu.py [--plain 1,2,4,8] [--diffpipe 1,2,4] [--steps 6]
                                 [--compile [--diffpipe-compiled 1] [--plain-compiled 8]]
                                 [--variant K=V,...] [--plain-last] [--repeat N]

--diffpipe lists stage counts hosted on the one GPU: "1" (one stage), "2" or "4" (run by the interleaved
schedule), each at micro-batch 8 and global batch 8 x stages. --compile adds diffpipe with `pipeline.compile =
true` (stage counts in --diffpipe-compiled) and then the plain loop compiled (micro-batches in --plain-compiled);
each compile takes about 5 minutes on an H200 with an empty inductor cache, so within 10-minute device calls
split them: `--plain 8 --diffpipe 1 --compile --diffpipe-compiled ""`, then
`--plain "" --diffpipe "" --compile --plain-compiled ""`. The plain loop is
the same step as bench/reference/plain_loop_gpu.py: FLOPs counted once with FlopCounterMode.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffpipe.models.families.unet.presets import UNET_PRESETS  # noqa: E402


def _inputs(b: int, dev: str) -> dict:
    return dict(sample=torch.randn(b, 4, 128, 128, device=dev), timestep=torch.randint(0, 1000, (b,), device=dev),
                encoder_hidden_states=torch.randn(b, 77, 2048, device=dev),
                added_cond_kwargs=dict(text_embeds=torch.randn(b, 1280, device=dev), time_ids=torch.randn(b, 6, device=dev)))


def plain_loop(batches: list[int], steps: int, compiled: bool) -> float:
    """The hand-written loop; returns FLOPs per sample (for diffpipe's TFLOP/s)."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(**UNET_PRESETS["sdxl"]).to("cuda").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    fwd = torch.compile(model) if compiled else model
    flops_per_sample = 0.0
    for b in batches:
        inp = _inputs(b, "cuda")
        with FlopCounterMode(display=False) as fc:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(**inp).sample
            out.float().pow(2).mean().backward()
        flops = fc.get_total_flops()
        flops_per_sample = flops / b
        opt.zero_grad(set_to_none=True)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = fwd(**inp).sample
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        warm_start = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - warm_start
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(json.dumps({"what": "plain", "compiled": compiled, "micro_batch": b, "step_s": round(med, 4),
                          "samples_per_s": round(b / med, 3), "tflops": round(flops / med / 1e12, 1),
                          "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                          "warmup_s": round(warm_s, 1)}), flush=True)
    del model, opt, fwd
    torch.cuda.empty_cache()
    return flops_per_sample


def diffpipe_run(chunks: int, steps: int, observe: bool, flops_per_sample: float, extra: list[str],
                 logs: Path | None = None, attempt: int = 0) -> None:
    """`diffpipe train` itself, as a user runs it, with `chunks` stages hosted on this one GPU."""
    with tempfile.TemporaryDirectory() as tmp:
        # steps 0-2 warm up, steps 3..steps+2 are measured; step 0 (timeline.png) and the last step are the
        # timed ones (observe.every), so no measured step waits for the device, and the last step's
        # stage peak covers every step since step 0. The step after the measured ones is not measured: its
        # time runs from the previous step's end only to when the host, ahead by the launch queue, got there
        sets = {"train.max_steps": steps + 5, "train.batch_size": 8 * chunks if chunks > 1 else 8,
                "pipeline.stages": 1, "pipeline.microbatches": chunks, "pipeline.split": '"auto"',
                "observe.enabled": str(observe).lower(), "observe.log_every": 0, "output.save_weights": "false",
                "pipeline.checkpointing": '"none"', "plan.memory_gib": 139,
                "observe.timeline_step": 0, "observe.every": steps + 4}
        if chunks > 1:
            sets.update({"pipeline.schedule": '"interleaved_1f1b"', "pipeline.virtual_stages": chunks})
        cmd = [sys.executable, "-m", "diffpipe", "train", str(ROOT / "examples" / "sdxl_unet.toml"),
               "--output-dir", f"{tmp}/run"]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        for item in extra:
            cmd += ["--set", item]
        started = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        wall_s = time.perf_counter() - started
        if logs is not None:  # the run's own output, e.g. TORCH_LOGS=recompiles,graph_breaks
            logs.mkdir(parents=True, exist_ok=True)
            name = f"diffpipe-{chunks}-{'-'.join(extra) or 'default'}-{attempt}".replace("=", "_").replace('"', "")
            (logs / f"{name}.log").write_text(result.stdout[-200_000:] + result.stderr[-800_000:])
        if result.returncode != 0:
            print(json.dumps({"what": "diffpipe", "chunks": chunks, "error": result.stderr[-1500:]}), flush=True)
            return
        metrics = Path(f"{tmp}/run/metrics.jsonl").read_text()
        if logs is not None:  # every step's time, to see how steady a run was
            (logs / f"{name}.metrics.jsonl").write_text(metrics)
        rows = [json.loads(line) for line in metrics.splitlines()]
    steady = rows[3:steps + 3]
    med = statistics.median(r["step_time_s"] for r in steady)
    batch = int(dict(item.split("=", 1) for item in extra).get("train.batch_size", sets["train.batch_size"]))
    peak = max((v for k, v in rows[-1].items() if k.endswith("_peak_gib")), default=None)
    print(json.dumps({"what": "diffpipe", "stages_on_gpu": chunks, "observe": observe, "extra": extra,
                      "global_batch": batch, "step_s": round(med, 4),
                      "samples_per_s": round(batch / med, 3), "tflops": round(flops_per_sample * batch / med / 1e12, 1),
                      "peak_gib": None if peak is None else round(peak, 2),
                      "bubble_fraction": rows[-1].get("bubble_fraction"), "first_step_s": rows[0]["step_time_s"],
                      "wall_s": round(wall_s, 1)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", default="1,2,4,8")
    parser.add_argument("--diffpipe", default="1,2,4", help="stages hosted on the GPU, comma separated")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--compile", action="store_true",
                        help="also the plain loop compiled at micro-batch 8 and diffpipe compiled (--diffpipe-compiled)")
    parser.add_argument("--diffpipe-compiled", default="1", help="with --compile: stage counts run with pipeline.compile")
    parser.add_argument("--plain-compiled", default="8", help="with --compile: micro-batches of the compiled plain loop")
    parser.add_argument("--overhead", action="store_true", help="also diffpipe 1 stage with observe off")
    parser.add_argument("--variant", action="append", default=[],
                        help="also diffpipe 1 stage with these comma-separated overrides, e.g. train.max_grad_norm=0")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each --diffpipe configuration this many times (fresh processes): eager diffpipe "
                             "runs have differed by 6 %% within one call")
    parser.add_argument("--plain-last", action="store_true",
                        help="measure the eager plain loop (--plain) again after the diffpipe runs: the GPU's speed "
                             "drifts between and within calls")
    parser.add_argument("--logs", type=Path, help="write each diffpipe run's output to a file in this folder")
    args = parser.parse_args()
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                      "date": time.strftime("%Y-%m-%d")}), flush=True)
    flops = plain_loop([int(b) for b in args.plain.split(",") if b], args.steps, False)
    if args.compile:
        for chunks in [int(c) for c in args.diffpipe_compiled.split(",") if c]:
            diffpipe_run(chunks, args.steps, True, flops, ["pipeline.compile=true"], args.logs)
        flops = plain_loop([int(b) for b in args.plain_compiled.split(",") if b], args.steps, True) or flops
    for chunks in [int(c) for c in args.diffpipe.split(",") if c]:
        for attempt in range(args.repeat):
            diffpipe_run(chunks, args.steps, True, flops, [], args.logs, attempt)
        if chunks == 1 and args.overhead:
            diffpipe_run(chunks, args.steps, False, flops, [], args.logs)
    for variant in args.variant:
        diffpipe_run(1, args.steps, True, flops, variant.split(","), args.logs)
    if args.plain_last:
        plain_loop([int(b) for b in args.plain.split(",") if b], args.steps, False)


if __name__ == "__main__":
    main()
