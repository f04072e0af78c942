"""`diffpipe report RUN_DIR`: a one-page summary of a run, as text and as report.png (loss, throughput,
per-stage time bars)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["summarise_run", "draw_report"]


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: is {run_dir} a run folder?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stages(rows: list[dict]) -> list[int]:
    return sorted({int(k[5:].split("_")[0]) for r in rows for k in r if k.startswith("stage") and k.endswith("_compute_s")})


def summarise_run(run_dir: str | Path) -> str:
    run_dir = Path(run_dir)
    rows = _metrics(run_dir)
    steady = rows[len(rows) // 5:] or rows  # leave out the warm-up fifth
    lines = [f"run {run_dir}: {len(rows)} steps logged, final loss {rows[-1]['loss']:.4f} "
             f"(first {rows[0]['loss']:.4f})",
             f"median step {statistics.median(r['step_time_s'] for r in steady):.4f} s, "
             f"{statistics.median(r['samples_per_s'] for r in steady):.1f} samples/s"]
    timed = [r for r in steady if "bubble_fraction" in r]  # steps the stages were timed (observe.every)
    if timed:
        lines.append(f"bubble {statistics.median(r['bubble_fraction'] for r in timed):.1%} "
                     f"(ideal {timed[-1]['ideal_bubble_fraction']:.1%})")
    for s in _stages(timed):
        med = {k: statistics.median(r[f"stage{s}_{k}"] for r in timed)
               for k in ("compute_s", "comm_s", "bubble_s", "optimizer_s", "peak_gib")}
        retries = sum(r.get(f"stage{s}_alloc_retries", 0) for r in rows)  # runs before this figure lack it
        exchanged = [r[f"stage{s}_all_to_all_s"] for r in timed if f"stage{s}_all_to_all_s" in r]  # sequence parallel
        within = f" (all-to-all {statistics.median(exchanged):.4f} s)" if exchanged else ""
        lines.append(f"stage {s}: compute {med['compute_s']:.4f} s{within}, comm {med['comm_s']:.4f} s, bubble "
                     f"{med['bubble_s']:.4f} s, optimizer {med['optimizer_s']:.4f} s, peak {med['peak_gib']:.2f} GiB"
                     + (f", {retries} allocator retries (memory nearly full)" if retries else ""))
    return "\n".join(lines)


def draw_report(run_dir: str | Path, out: str | Path) -> None:
    run_dir = Path(run_dir)
    rows = _metrics(run_dir)
    steps = [r["step"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 3.8))
    a.plot(steps, [r["loss"] for r in rows], lw=0.8)
    a.set_yscale("log")
    a.set_title("loss")
    b.plot(steps, [r["samples_per_s"] for r in rows], lw=0.8)
    b.set_title("samples/s")
    stages = _stages(rows)
    steady = [r for r in (rows[len(rows) // 5:] or rows) if "bubble_fraction" in r]
    bottom = [0.0] * len(stages)
    for key, colour in (("compute_s", "tab:blue"), ("comm_s", "tab:orange"), ("bubble_s", "tab:grey"),
                        ("optimizer_s", "tab:green")):
        values = [statistics.median(r[f"stage{s}_{key}"] for r in steady) for s in stages]
        c.bar([f"stage {s}" for s in stages], values, bottom=bottom, color=colour, label=key[:-2])
        bottom = [x + y for x, y in zip(bottom, values)]
    c.set_title("median seconds per step")
    c.legend(fontsize=8)
    for ax in (a, b):
        ax.set_xlabel("step")
    fig.suptitle(summarise_run(run_dir).splitlines()[0], fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
