"""A diffpipe command on one GPU capped to a smaller card's memory, as issue 33 measures its levers: the CUDA
allocator of this process may hold no more than --gib (torch.cuda.set_per_process_memory_fraction), so a run that
needs more fails here as it would on that card. Runs the command in this process (one pipeline process: diffpipe
trains in the calling process then), and prints one JSON line: exit code, seconds, the allocator's peak allocated and
reserved bytes, and from the run's metrics: samples/s (mean over steps after --skip) and the most any timed step
allocated (`observed_peak_gib`: the figure to hold against the plan; the allocator's own peak counts only what came
after the observer's last reset).

    python bench/capped_card.py --gib 24 --out capped.jsonl -- train examples/flux_dev.toml --set ... \\
        --output-dir runs/capped --overwrite
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

GIB = 2 ** 30


def _metrics(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []


def _samples_per_second(rows: list[dict], skip: int) -> float | None:
    """The run's mean samples/s over its steps after the first `skip` (compilation, allocator warm-up)."""
    rates = [r["samples_per_s"] for r in rows if r.get("step", 0) >= skip and r.get("samples_per_s")]
    return round(sum(rates) / len(rates), 3) if rates else None


def _observed_peak_gib(rows: list[dict]) -> float | None:
    """The most any stage allocated in any timed step (the observer's stageN_peak_gib)."""
    peaks = [v for r in rows for k, v in r.items() if k.startswith("stage") and k.endswith("_peak_gib")]
    return round(max(peaks), 2) if peaks else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, required=True, help="the card's memory to emulate, GiB")
    parser.add_argument("--out", type=Path, help="append the JSON line to this file too")
    parser.add_argument("--label", default="", help="a name for the row")
    parser.add_argument("--skip", type=int, default=3, help="steps left out of samples/s")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then a diffpipe command and its arguments")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command

    import torch

    from diffpipe.cli import main as diffpipe_main

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.gib * GIB / total), 0)
    start = time.perf_counter()
    try:
        code = diffpipe_main(command)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except torch.OutOfMemoryError as exc:
        print(f"out of memory: {str(exc).splitlines()[0]}", file=sys.stderr)
        code = "out of memory"
    run_dir = Path(command[command.index("--output-dir") + 1]) if "--output-dir" in command else None
    rows = _metrics(run_dir) if run_dir else []
    row = {"label": args.label, "cap_gib": args.gib, "exit": code, "seconds": round(time.perf_counter() - start, 1),
           "peak_allocated_gib": round(torch.cuda.max_memory_allocated(0) / GIB, 2),
           "peak_reserved_gib": round(torch.cuda.max_memory_reserved(0) / GIB, 2),
           "observed_peak_gib": _observed_peak_gib(rows), "samples_per_s": _samples_per_second(rows, args.skip)}
    print(json.dumps(row), flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
