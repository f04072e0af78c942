"""The `diffpipe` command.

    diffpipe train examples/digits.toml [--set train.max_steps=50] [--output-dir runs/x] [--overwrite]
    diffpipe train examples/digits.toml --resume runs/digits [--set pipeline.stages=4]  # from its last checkpoint
    diffpipe plan examples/sdxl_unet.toml --set pipeline.stages=4 [--world-size 8] [--gpu-memory 80GiB] [--json]
        [--profile] [--probe | --probe-unsplit]
    diffpipe timeline runs/digits [--step N] --out timeline.png
    diffpipe report runs/digits
    diffpipe sample runs/digits --prompt "a handwritten digit seven" --num 8 --seed 0 --steps 30 --out seven.png
    diffpipe cache examples/photos.toml [--processes N]               # image folders: latents and text ahead
    diffpipe export runs/photos --format diffusers|kohya|original --out PATH   # for diffusers, ComfyUI, A1111, kohya
    diffpipe config [--markdown]                                      # every config key, its default and help
    torchrun --nnodes 2 --nproc-per-node 4 ... -m diffpipe train CONFIG   # multi-node: one process per GPU

`train` starts pipeline.stages x pipeline.data_parallel processes itself unless torchrun already did.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["main"]


_MIN_SIDE_PX = 64  # `diffpipe sample` enlarges smaller images (nearest neighbour) to at least this height


class UserError(Exception):
    """Bad input: printed as one message, without a traceback."""


def _prepare_run(args) -> tuple:
    from .config import load_config, make_paths_absolute, save_config
    from .distributed import prepare_to_launch

    config = make_paths_absolute(load_config(args.config, args.set or []))
    prepare_to_launch(config.world_size)  # the processes' imports run while this one checks (below)

    from .build import boundary_traffic
    from .preflight import check_before_launch
    from .pipeline.traffic import format_crossings
    from .run_folder import RunLock, prepare_new_run

    if _restarted_by_torchrun(args, config):
        args.resume = args.output_dir or config.output.dir
    if args.resume:
        config.output.dir = args.resume
    elif args.output_dir:
        config.output.dir = args.output_dir
    checked = check_before_launch(config)
    config.pipeline.split, config.pipeline.checkpointing = checked.split, checked.checkpointing
    for key, value in checked.memory.items():  # chosen by the planner ("auto")
        setattr(config.memory, key, value)
    run_dir = Path(config.output.dir)
    is_main = int(os.environ.get("RANK", "0")) == 0
    # each machine's first process prepares that machine's run folder (machines may share no disk)
    prepares_folder = int(os.environ.get("LOCAL_RANK", "0")) == 0
    lock = None
    if prepares_folder:  # every check first: a finished run is replaced only by a run that passed them all
        _check_free_space(run_dir, checked.backbone, config)
        try:
            if args.resume:
                lock = RunLock(run_dir) if (run_dir / "config.toml").is_file() else None
                _check_resumable(config, run_dir, checked.backbone)
            else:
                lock = prepare_new_run(run_dir, args.overwrite)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        save_config(config, run_dir / "config.toml")
    if is_main:
        print(f"training {config.model.describe()} on {config.world_size} process(es): "
              f"{config.pipeline.stages} stage(s) x {config.pipeline.data_parallel} replica(s), split at units "
              f"{config.pipeline.split}, schedule {config.pipeline.schedule}; run folder {run_dir}", flush=True)
        print("tensors crossing each stage boundary:\n" + format_crossings(
            boundary_traffic(config, checked.backbone, checked.split)), flush=True)
    return config, run_dir, is_main, lock


def _restarted_by_torchrun(args, config) -> bool:
    """Under `torchrun --max-restarts N`, workers started again after a failure resume from the run's newest
    checkpoint by themselves (every process decides alike: the folder is only emptied when there is none); with
    none yet, the run starts over."""
    from .train.checkpoint import latest_checkpoint

    if args.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return False
    if latest_checkpoint(Path(args.output_dir or config.output.dir)) is not None:
        return True
    args.overwrite = True
    return False


def _check_free_space(run_dir: Path, backbone, config) -> None:
    """Refuse to start a run whose weights and checkpoints could not be written at its end."""
    import shutil
    import tempfile

    params = sum(p.numel() for p in backbone.model.parameters())
    # fp32 weights in model.safetensors, and in each checkpoint kept beside AdamW's two moments
    on = config.checkpoint.every > 0 or config.checkpoint.every_minutes > 0
    kept = config.checkpoint.keep + 1 if on else 0
    needed = 4 * params * (1 + 3 * kept) if config.output.save_weights else 0
    existing = run_dir
    while not existing.exists() and existing != existing.parent:  # the folder may not exist yet
        existing = existing.parent
    if existing.is_dir():
        try:  # root passes os.access everywhere, and /sys refuses anyway: only a write tells
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as exc:
            raise UserError(f"cannot write the run folder {run_dir} ({exc.strerror}); choose another with "
                            "--output-dir") from None
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise UserError(f"{run_dir}: {_readable_size(free)} free, but the weights and {kept} checkpoint(s) need "
                        f"{_readable_size(needed)}; free space, choose another --output-dir, or lower checkpoint.keep")


def _readable_size(nbytes: float) -> str:
    """Bytes in the unit that reads best: 1000 B, 812.0 KiB, 3.1 MiB, 12.4 GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


def _check_resumable(config, run_dir: Path, backbone) -> None:
    """Refuse, before any process starts, a resume whose run folder, checkpoint or config does not fit."""
    from .config import load_config, make_paths_absolute
    from .train.checkpoint import latest_checkpoint, model_shapes, unsafe_changes, verify_checkpoint

    if not (run_dir / "config.toml").is_file():
        raise UserError(f"--resume {run_dir}: no run there (config.toml is missing)")
    path = latest_checkpoint(run_dir)
    if path is None:
        raise UserError(f"--resume {run_dir}: the run has no complete checkpoint (checkpoint.every was 0, or it "
                        "stopped before the first one); start it again instead")
    several_machines = int(os.environ.get("WORLD_SIZE", "1")) > int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    step = verify_checkpoint(path, model_shapes(backbone.model), elsewhere_ok=several_machines)
    saved = make_paths_absolute(load_config(run_dir / "config.toml")).model_dump(mode="json")  # older runs: relative
    changed = unsafe_changes(saved, config.model_dump(mode="json"))
    if changed:
        raise UserError(f"--resume {run_dir}: the config differs from the run's in what a resumed run must keep: "
                        + "; ".join(changed) + ". Use the run's config (its config.toml), or start a new run")
    if step >= config.train.max_steps:
        raise UserError(f"--resume {run_dir}: the checkpoint is at step {step}, train.max_steps is "
                        f"{config.train.max_steps}; raise it to train on (--set train.max_steps=N)")
    print(f"resuming {run_dir} from {path} (step {step})", flush=True)


def _train(args) -> None:
    from .distributed import launch
    from .train.worker import train_worker

    config, run_dir, is_main, lock = _prepare_run(args)
    try:
        launch(train_worker, (config.model_dump(mode="json"), str(run_dir), bool(args.resume)), config.world_size)
        if is_main:
            _finish(config, run_dir)
    finally:
        if lock is not None:
            lock.release()


def _finish(config, run_dir: Path) -> None:
    from .data.sources import source_of
    from .sampling import grid_prompts, grid_scale, load_generator, save_grid
    from .train.records import plot_loss

    plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
    if config.output.sample_every_end and config.output.save_weights and source_of(config).samples:
        gen = load_generator(run_dir)
        seeds = config.sample.seeds
        columns = grid_prompts(config, lambda: _folder_captions(config))
        prompts = [p for _ in seeds for p in columns]
        row_seeds = [s for s in seeds for _ in columns]
        images = gen.generate(prompts, row_seeds, config.sample.steps, config.sample.guidance_scale)
        written = save_grid(images, len(seeds), run_dir / "samples.png", scale=grid_scale(config))
        print(f"samples: {written}", flush=True)
    print(f"done: {run_dir}", flush=True)


def _folder_captions(config) -> list[str]:
    from .data.folder import Skipped, scan_folders
    from .data.images import data_folders

    return [item.caption for item in scan_folders(data_folders(config.data), 0, Skipped())]


def _sample(args) -> None:
    from .sampling import load_generator, save_grid

    for name, value in (("--num", args.num), ("--steps", args.steps)):
        if value is not None and value < 1:
            raise UserError(f"{name} {value}: give 1 or more")
    _check_image_path(Path(args.out))  # before minutes of sampling, not after
    gen = load_generator(args.run_dir)
    steps = gen.config.sample.steps if args.steps is None else args.steps
    guidance = gen.config.sample.guidance_scale if args.guidance is None else args.guidance
    seeds = [args.seed + i for i in range(args.num)]
    images = gen.generate([args.prompt] * args.num, seeds, steps, guidance)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    scale = -(-_MIN_SIDE_PX // images.shape[-2])  # tiny images (8x8 digits) enlarged to be seen when opened
    written = save_grid(images, 1, args.out, scale=scale)
    print(f"wrote {args.num} image(s) to {written}" + (f", each enlarged {scale}x" if scale > 1 else ""))


def _check_image_path(out: Path) -> None:
    from PIL import Image

    writable = {ext for ext, name in Image.registered_extensions().items() if name in Image.SAVE}
    if out.suffix.lower() not in writable:
        raise UserError(f"--out {out}: give an image file name (.png, .jpg, .webp; clips are written as .gif)")
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; give an image file name such as {out / 'samples.png'}")


def _cache(args) -> None:
    from .commands.cache import cache_command

    if args.processes < 1:
        raise UserError(f"--processes {args.processes}: give 1 or more")
    cache_command(args.config, args.set or [], args.processes)


def _export(args) -> None:
    from .export import ExportError, export_run

    try:
        written = export_run(Path(args.run_dir), args.format, Path(args.out), force=args.force)
    except ExportError as exc:
        raise UserError(str(exc)) from None
    print(f"wrote {written}")


def _plan(args) -> None:
    from .config import load_config
    from .commands.plan import plan_command

    config = load_config(args.config, args.set or [])
    plan_command(config, args.world_size, args.gpu_memory, args.json, args.profile, args.probe, args.probe_unsplit)


def _timeline(args) -> None:
    import json

    from .observe.timeline import chrome_trace, draw_timeline, read_step_intervals

    record = read_step_intervals(args.run_dir, args.step)
    draw_timeline(record, args.out)
    trace = Path(args.out).with_suffix(".json")
    trace.write_text(json.dumps(chrome_trace(record)))
    print(f"wrote {args.out} and {trace} (open it in ui.perfetto.dev) for step {record['step']}")


def _report(args) -> None:
    from .observe.report import draw_report, summarise_run

    print(summarise_run(args.run_dir))
    out = args.out or str(Path(args.run_dir) / "report.png")
    draw_report(args.run_dir, out)
    print(f"wrote {out}")


def _config(args) -> None:
    from .config_reference import config_reference

    print(config_reference(markdown=args.markdown))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffpipe", description="Pipeline-parallel diffusion training.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a TOML config")
    train.add_argument("config")
    train.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    train.add_argument("--output-dir", help="run folder (overrides output.dir)")
    train.add_argument("--overwrite", action="store_true", help="replace an existing run folder's contents")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint "
                       "(on any number of stages and replicas)")
    train.set_defaults(run=_train)
    plan = sub.add_parser("plan", help="show the planned stage split, its costs and the parameter-count split")
    plan.add_argument("config")
    plan.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    plan.add_argument("--world-size", type=int, help="search stages x data parallel x micro-batches for N devices")
    plan.add_argument("--gpu-memory", help="memory per device, e.g. 80GiB (default: the GPU's, unlimited on CPU)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.add_argument("--profile", action="store_true", help="time each unit on this device and save plan.profile")
    plan.add_argument("--probe", action="store_true",
                      help="then run each planned stage alone on this device (AdamW state, micro-batches in flight): "
                           "probed time and peak memory beside the plan's")
    plan.add_argument("--probe-unsplit", action="store_true", help="--probe, and the whole model as one stage first")
    plan.set_defaults(run=_plan)
    cache = sub.add_parser("cache", help="compute an image-folder run's VAE latents and text-encoder outputs ahead")
    cache.add_argument("config")
    cache.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    cache.add_argument("--processes", type=int, default=1, help="processes sharing the work (one per GPU)")
    cache.set_defaults(run=_cache)
    timeline = sub.add_parser("timeline", help="draw one step of a run as a Gantt chart, one row per rank")
    timeline.add_argument("run_dir")
    timeline.add_argument("--step", type=int, default=None, help="default: the last recorded step")
    timeline.add_argument("--out", required=True)
    timeline.set_defaults(run=_timeline)
    report = sub.add_parser("report", help="one-page summary of a run (text and PNG)")
    report.add_argument("run_dir")
    report.add_argument("--out", default=None, help="PNG path (default RUN_DIR/report.png)")
    report.set_defaults(run=_report)
    sample = sub.add_parser("sample", help="generate images from a finished run")
    sample.add_argument("run_dir")
    sample.add_argument("--prompt", required=True)
    sample.add_argument("--num", type=int, default=1)
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--steps", type=int, default=None)
    sample.add_argument("--guidance", type=float, default=None, help="classifier-free guidance scale")
    sample.add_argument("--out", required=True)
    sample.set_defaults(run=_sample)
    export = sub.add_parser("export", help="a finished run's weights for diffusers, ComfyUI, A1111 or kohya's tools")
    export.add_argument("run_dir")
    export.add_argument("--format", required=True, choices=["diffusers", "kohya", "original"],
                        help="diffusers: a pipeline folder (full) or LoRA file; kohya: LoRA for ComfyUI/A1111/kohya; "
                             "original: the UNet as one file in the original layout")
    export.add_argument("--out", required=True, help="folder (diffusers) or .safetensors file")
    export.add_argument("--force", action="store_true", help="replace an existing --out (never the run's own files)")
    export.set_defaults(run=_export)
    config = sub.add_parser("config", help="every config key: section, type, default and what it does")
    config.add_argument("--markdown", action="store_true", help="as docs/config.md")
    config.set_defaults(run=_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # before the heavy imports: `diffpipe --help` answers at once
    try:
        return _main(args)
    except KeyboardInterrupt:  # Ctrl-C before any process started (imports, checks): nothing to save
        print(f"diffpipe {args.command}: interrupted before training began; nothing was saved", file=sys.stderr)
        return 130


def _main(args) -> int:
    from transformers.utils import logging as transformers_logging

    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    from .distributed import Interrupted, WorkerFailed
    from .errors import DiffpipeError
    from .torch_support import check_torch
    from .train.stopping import TrainingStopped

    transformers_logging.disable_progress_bar()  # per-file bars of tiny local saves and loads are noise
    try:
        untested = check_torch()
        if untested and int(os.environ.get("RANK", "0")) == 0:
            print(f"diffpipe {args.command}: warning: {untested}", file=sys.stderr)
        args.run(args)
    except (UserError, DiffpipeError, FileNotFoundError) as exc:
        print(f"diffpipe {args.command}: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"diffpipe {args.command}: {exc}", file=sys.stderr)
        return 130
    except TrainingStopped as exc:  # under torchrun: this process's own
        print(f"diffpipe {args.command}: training stopped: {exc}", file=sys.stderr)
        return 1
    except (ProcessRaisedException, ProcessExitedException, WorkerFailed) as exc:  # a started process failed
        print(f"diffpipe {args.command}: {_worker_failure(str(exc))}", file=sys.stderr)
        return 1
    return 0


def _worker_failure(text: str) -> str:
    """One line for a failed training process: its own message when it stopped on purpose, else its error's last
    line (the traceback above it was printed by that process)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else text
    stopped = "TrainingStopped: "
    if stopped in last:
        return "training stopped: " + last.split(stopped, 1)[1]
    return f"a training process failed: {last}"


if __name__ == "__main__":
    sys.exit(main())
