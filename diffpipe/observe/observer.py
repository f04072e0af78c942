"""Where each stage's time goes, step by step: gathered from every rank, written where users look.

Per pipeline rank and step: compute (forward + backward intervals), optimizer, idle time inside the
schedule, peak memory and the CUDA allocator's retries (a warning when memory ran out of cached blocks). Idle
splits into communication, estimated as the bytes the rank moves times the seconds per byte measured between
neighbouring ranks at start-up (`probe_link`), and bubble (the rest: waiting on other stages). Where the processes
of a sample split its tokens (pipeline.sequence_parallel), the part of compute spent in attention's all-to-alls is
estimated the same way: the bytes the step's attentions gave them (counted as they ran) times the seconds per byte
of an all-to-all among them measured at start-up (`probe_all_to_all`). Rank 0 adds
per-stage fields to metrics.jsonl, appends every rank's intervals to stage_times.jsonl, writes TensorBoard
scalars, prints a line per stage every `observe.log_every` steps, draws the timeline of `observe.timeline_step`,
and runs the monitor, whose action every rank then takes.
"""
from __future__ import annotations

import json
import resource
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..distributed import Topology
from ..pipeline.schedules import ideal_bubble
from .monitor import PipelineMonitor
from .timeline import chrome_trace, draw_timeline
from ..pipeline.timing import StepTimes

__all__ = ["PipelineObserver", "probe_link", "probe_all_to_all", "memory_pressure_warnings"]

GIB = 2**30


def _seconds_per_byte(exchange, nbytes: int, device: torch.device, repeats: int) -> list[float]:
    """Seconds per byte of `exchange()` (moving `nbytes`), each of `repeats` runs after one that sets up the
    connections."""
    measured = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        exchange()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        measured.append((time.perf_counter() - start) / nbytes)
    return measured[1:]


def probe_link(topo: Topology, nbytes: int = 4 * 2**20, repeats: int = 3) -> float:
    """Seconds per byte between neighbouring pipeline ranks (round trips of `nbytes`), 0 without neighbours."""
    if topo.pp_size == 1:
        return 0.0
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=topo.device)
    group = topo.send_group  # the link the stages' sends take (unbatched P2P on the default group serialises)
    measured = []
    for phase in (0, 1):  # pairs (0,1),(2,3).. then (1,2),(3,4).. so no rank waits on two partners at once
        lower = topo.pp_rank if (topo.pp_rank - phase) % 2 == 0 else topo.pp_rank - 1
        if lower < 0 or lower + 1 >= topo.pp_size or topo.pp_rank not in (lower, lower + 1):
            continue
        partner = topo.rank + (1 if topo.pp_rank == lower else -1)

        def round_trip(partner=partner, first=topo.pp_rank == lower):
            for step in ((dist.send, dist.recv) if first else (dist.recv, dist.send)):
                step(buf, partner, group=group)
        measured += _seconds_per_byte(round_trip, 2 * nbytes, topo.device, repeats)
    return min(measured) if measured else 0.0


def probe_all_to_all(topo: Topology, nbytes: int = 4 * 2**20, repeats: int = 3) -> float:
    """Seconds per byte of an all-to-all among the processes of one sample (each giving `nbytes`, the fastest of
    `repeats` after one that sets up the connections), 0 where a process holds its samples whole."""
    if topo.sp_size == 1:
        return 0.0
    group = topo.sp_mesh["ulysses"].get_group()
    nbytes = nbytes // (4 * topo.sp_size) * 4 * topo.sp_size  # an equal part for each process
    given = torch.zeros(nbytes // 4, dtype=torch.float32, device=topo.device)
    taken = torch.empty_like(given)
    return min(_seconds_per_byte(lambda: dist.all_to_all_single(taken, given, group=group), nbytes, topo.device,
                                 repeats))


def _allocator_retries(device: torch.device) -> int:
    """Times the CUDA caching allocator found no free block, emptied its cache and tried again (each waits for
    the GPU); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def memory_pressure_warnings(step: int, ranks: list[dict]) -> list[str]:
    """A warning per rank whose allocator retried since the previous timed step: its memory is nearly full,
    and every retry stalls the pipeline while the cache is returned to the driver."""
    return [f"warning: step {step}: stage {r['pp_rank']} (rank {r['rank']}) ran out of cached GPU memory "
            f"{r['alloc_retries']} time(s) since the last timed step (peak {r['peak_gib']:.1f} GiB); each time the "
            "allocator waits for the GPU and returns its cache. Try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
            "a smaller micro-batch, pipeline.checkpointing or a lower plan.memory_gib"
            for r in ranks if r.get("alloc_retries", 0) > 0]


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident set since start (Linux: KiB)


class PipelineObserver:
    def __init__(self, config: RunConfig, topo: Topology, run_dir: Path, moved_bytes_per_step: int,
                 seconds_per_byte: float, writer=None, all_to_all_seconds_per_byte: float = 0.0):
        self.config, self.topo, self.run_dir = config, topo, run_dir
        self.moved_bytes_per_step, self.seconds_per_byte = moved_bytes_per_step, seconds_per_byte
        self.all_to_all_seconds_per_byte = all_to_all_seconds_per_byte
        obs = config.observe
        self.monitor = PipelineMonitor(factor=obs.anomaly_factor, warmup=obs.anomaly_warmup)
        self.writer = writer
        p = config.pipeline
        self.ideal = ideal_bubble(p.schedule, p.stages, p.microbatches, p.virtual_stages)  # with equal stages
        self._retries_seen = _allocator_retries(topo.device)

    def _summary(self, times: StepTimes) -> dict:
        summary = {"rank": self.topo.rank, "pp_rank": self.topo.pp_rank, "replica_rank": self.topo.replica_rank,
                   "schedule_s": times.step_s, "compute_s": times.compute_s,
                   "optimizer_s": times.optimizer_s, "comm_s": self.moved_bytes_per_step * self.seconds_per_byte,
                   "all_to_all_s": times.exchanged_bytes * self.all_to_all_seconds_per_byte,
                   "all_to_all_mib": times.exchanged_bytes / 2**20,
                   "peak_gib": _peak_bytes(self.topo.device) / GIB,
                   "intervals": [asdict(i) for i in times.intervals]}
        retries = _allocator_retries(self.topo.device)
        summary["alloc_retries"], self._retries_seen = retries - self._retries_seen, retries
        if self.topo.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.topo.device)
        return summary

    def after_step(self, step: int, record: dict, times: StepTimes) -> str:
        """Gather, record and judge one step; returns the action every rank takes: continue, checkpoint, stop."""
        gathered: list = [None] * self.topo.world_size
        dist.all_gather_object(gathered, self._summary(times))
        action = "continue"
        if self.topo.is_main:
            action = self._record(step, record, sorted((g for g in gathered if g["replica_rank"] == 0),
                                                       key=lambda g: g["pp_rank"]))
        decision = [action]
        dist.broadcast_object_list(decision, src=0)
        return decision[0]

    def _record(self, step: int, record: dict, ranks: list[dict]) -> str:
        # every rank starts the step together (the previous step ends in collectives), so one window covers
        # the pipeline: a stage that finishes early was idle for the rest of it, as in the textbook bubble
        window = max(r["schedule_s"] for r in ranks)
        for r in ranks:
            r["idle_s"] = max(0.0, window - r["compute_s"])
            r["comm_s"] = min(r["comm_s"], r["idle_s"])
            r["bubble_s"] = r["idle_s"] - r["comm_s"]
        bubble = sum(r["bubble_s"] for r in ranks) / (window * len(ranks)) if window > 0 else 0.0
        record.update(bubble_fraction=bubble, ideal_bubble_fraction=self.ideal)
        split = self.topo.sp_size > 1  # attention's all-to-alls, a part of compute
        for r in ranks:
            for key in ("compute_s", "comm_s", "bubble_s", "optimizer_s", "peak_gib", "alloc_retries") + (
                    ("all_to_all_s", "all_to_all_mib") if split else ()):
                record[f"stage{r['pp_rank']}_{key}"] = r[key]
        line = {"step": step, "schedule": self.config.pipeline.schedule, "bubble_fraction": bubble,
                "ideal_bubble_fraction": self.ideal, "ranks": ranks}
        with (self.run_dir / "stage_times.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        if step == self.config.observe.timeline_step:
            draw_timeline(line, self.run_dir / "timeline.png")
            (self.run_dir / "timeline.json").write_text(json.dumps(chrome_trace(line)))
        if self.config.observe.log_every and step % self.config.observe.log_every == 0:
            for r in ranks:
                own = r["bubble_s"] / max(1e-12, window)
                exchanged = f" (all-to-all {r['all_to_all_s']:.3f} s)" if split else ""
                print(f"stage {r['pp_rank']} (of {len(ranks)}) step {step}: compute {r['compute_s']:.3f} s{exchanged}, "
                      f"comm {r['comm_s']:.3f} s, bubble {r['bubble_s']:.3f} s ({own:.1%}, ideal {self.ideal:.1%}), "
                      f"peak {r['peak_gib']:.2f} GiB", flush=True)
        if self.writer is not None:
            self.writer.add_scalar("pipeline/bubble_fraction", bubble, step)
            for r in ranks:
                for key in ("compute_s", "comm_s", "bubble_s", "peak_gib") + (("all_to_all_s",) if split else ()):
                    self.writer.add_scalar(f"stage{r['pp_rank']}/{key}", r[key], step)
        return self._judge(step, ranks, record.get("bucket"))  # image and clip folders name the bucket

    def _judge(self, step: int, ranks: list[dict], shape: str | None) -> str:
        alerts = []
        for r in ranks:
            alerts += self.monitor.observe(r["pp_rank"], r["rank"], {"step latency": r["compute_s"],
                                                                      "communication latency": r["comm_s"]}, shape)
        for alert in alerts:
            print(f"warning: {alert.message(step)}; action: {self.config.observe.on_anomaly}", flush=True)
        for warning in memory_pressure_warnings(step, ranks):  # a cause to fix, not a slowdown to act on
            print(warning, flush=True)
        return self.config.observe.on_anomaly if alerts else "continue"
