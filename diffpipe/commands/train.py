"""`diffpipe train`: check a config before anything starts (planner, memory, free disk, a resume's checkpoint), prepare
the run folder, start pipeline.stages x pipeline.data_parallel processes (unless torchrun did), then plot the loss
and draw the samples.

    diffpipe train examples/digits.toml [--set train.max_steps=50] [--output-dir runs/x] [--overwrite]
    diffpipe train examples/digits.toml --resume runs/digits [--set pipeline.stages=4]
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import CommandError

__all__ = ["train_command"]


def _prepare_run(args) -> tuple:
    """The run's config checked, the planner's choices taken into it, its folder prepared (this machine's first
    process) and what it trains said (the first process): (config, run folder, whether this process is the first,
    the folder's lock)."""
    from ..planner.plan import take_stages
    from ..preflight import check_before_launch

    config = _run_config(args)
    checked = check_before_launch(config)
    config.train.fp8_compute = checked.fp8_compute  # "auto" resolved
    is_main = int(os.environ.get("RANK", "0")) == 0
    if is_main:
        _say_what_trains(config, checked.backbone, checked.device_kind)
    _check_export_format(config, checked.backbone)
    take_stages(config.pipeline, checked.split, checked.recomputed)
    for key, value in checked.memory.items():  # chosen by the planner ("auto")
        setattr(config.memory, key, value)
    run_dir = Path(config.output.dir)
    # each machine's first process prepares that machine's run folder (machines may share no disk)
    lock = _prepare_folder(args, config, checked.backbone) if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
    if is_main:
        from ..build import boundary_traffic
        from ..pipeline.traffic import format_crossings

        print(f"training {config.model.describe()} on {config.world_size} process(es): "
              f"{config.pipeline.stages} stage(s) x {config.pipeline.data_parallel} replica(s)"
              f"{_sequence_words(config.pipeline.sequence_parallel)}, split at units "
              f"{config.pipeline.split}, schedule {config.pipeline.schedule}; run folder {run_dir}", flush=True)
        print("tensors crossing each stage boundary:\n" + format_crossings(
            boundary_traffic(config, checked.backbone, checked.split)), flush=True)
    return config, run_dir, is_main, lock


def _sequence_words(degree: int) -> str:
    return f" x {degree} processes sharing each sample's tokens" if degree > 1 else ""


def _run_config(args):
    """The config file with its --set values, paths made absolute, output.dir the folder this run writes (a
    resume's own, or --output-dir); the processes' imports start meanwhile."""
    from ..config import make_paths_absolute
    from ..config_files import load_config
    from ..distributed import prepare_to_launch

    config = make_paths_absolute(load_config(args.config, args.set or []))
    prepare_to_launch(config.world_size)  # the processes' imports run while this one checks
    if args.resume and args.output_dir and Path(args.resume).resolve() != Path(args.output_dir).resolve():
        # a resume continues its own folder (checkpoints pruned, weights replaced): never when another was named
        raise CommandError(f"--resume {args.resume} continues that run in its own folder, and --output-dir "
                           f"{args.output_dir} names another: leave --output-dir out to continue it there, or to "
                           f"continue it elsewhere copy it first (cp -r {args.resume} {args.output_dir}) and "
                           f"--resume {args.output_dir}")
    if _restarted_by_torchrun(args, config):
        args.resume = args.output_dir or config.output.dir
    if args.resume:
        config.output.dir = args.resume
    elif args.output_dir:
        config.output.dir = args.output_dir
    return config


def _say_what_trains(config, backbone, device_kind: str) -> None:
    """The optimizer's note, what fp8 compute and fp8 attention compute in fp8, and which expert (or both) of a
    two-expert folder trains on which timesteps."""
    from ..build import timestep_range
    from ..train.optim import optimizer_note

    note = optimizer_note(config.train)
    if note is not None:
        print(note, flush=True)
    if config.train.fp8_compute is True and config.adapter.type == "none":
        from ..models.fp8_training import fp8_training_words

        print(fp8_training_words(backbone.model, device_kind), flush=True)
    elif config.train.fp8_compute and config.adapter.type != "none":
        from ..models.storage import fp8_compute_words

        print(fp8_compute_words(backbone.model), flush=True)
    if config.train.fp8_attention:
        from ..models.fp8_attention import fp8_attention_words

        print(fp8_attention_words(backbone.model, backbone.family.fp8_attention_processors), flush=True)
    if config.model.expert == "both":
        print(f"model.expert = \"both\": each sample trains the expert its timestep picks (transformer/ from "
              f"{backbone.model.boundary / 1000:.3f} up, transformer_2/ below), both on every stage; samples "
              "during training use both, as WanPipeline does", flush=True)
    elif config.model.expert is not None:
        low, high = timestep_range(config)
        print(f"model.expert = \"{config.model.expert}\": trains on timesteps {low:.3f} to {high:.3f} (1 = pure "
              "noise); samples during training are this expert's at every step (the other is not loaded): a rough "
              "view, judge it in WanPipeline with both experts after export", flush=True)


def _check_export_format(config, backbone) -> None:
    """checkpoint.export_every's format can hold this run's adapters: asked now, not at the first export."""
    if not (config.checkpoint.export_every or config.checkpoint.export_every_epochs):
        return
    from ..export.run import ExportedRun, format_writer
    from ..models.lora import adapted_module, is_adapter

    adapted = tuple(sorted({adapted_module(n) for n, _ in backbone.model.named_parameters() if is_adapter(n)}))
    format_writer(config.checkpoint.export_format).check(ExportedRun(
        Path(config.output.dir), config, backbone.family, dict(backbone.model.config), adapted))


def _prepare_folder(args, config, backbone):
    """This machine's run folder made ready, after every check (a finished run is replaced only by a run that passed
    them all): a new run's emptied and locked, a resume's checked and its unfinished saves removed; the config
    written. Returns the folder's lock."""
    from ..config import save_config
    from ..run_folder import RunLock, prepare_new_run
    from ..train.checkpoint import remove_unfinished_saves

    run_dir = Path(config.output.dir)
    _check_free_space(run_dir, backbone, config)
    lock = None
    try:
        if args.resume:
            lock = RunLock(run_dir) if (run_dir / "config.toml").is_file() else None
            _check_resumable(config, run_dir, backbone)
            for unfinished in remove_unfinished_saves(run_dir):
                print(f"removed {unfinished}: a checkpoint save that never finished", flush=True)
        else:
            lock = prepare_new_run(run_dir, args.overwrite)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    save_config(config, run_dir / "config.toml")
    return lock


def _restarted_by_torchrun(args, config) -> bool:
    """Under `torchrun --max-restarts N`, workers started again after a failure resume from the run's newest
    checkpoint by themselves (every process decides alike: the folder is only emptied when there is none); with
    none yet, the run starts over."""
    from ..train.checkpoint import latest_checkpoint

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
            raise CommandError(f"cannot write the run folder {run_dir} ({exc.strerror}); choose another with "
                            "--output-dir") from None
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise CommandError(f"{run_dir}: {_readable_size(free)} free, but the weights and {kept} checkpoint(s) need "
                        f"{_readable_size(needed)}; free space, choose another --output-dir, or lower checkpoint.keep")


def _readable_size(nbytes: float) -> str:
    """Bytes in the unit that reads best: 1000 B, 812.0 KiB, 3.1 MiB, 12.4 GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


def _check_resumable(config, run_dir: Path, backbone) -> None:
    """Refuse, before any process starts, a resume whose run folder, checkpoint or config does not fit."""
    from ..config import make_paths_absolute
    from ..config_files import load_config
    from ..train.checkpoint import latest_checkpoint, model_shapes, unsafe_changes, verify_checkpoint

    if not (run_dir / "config.toml").is_file():
        raise CommandError(f"--resume {run_dir}: no run there (config.toml is missing)")
    path = latest_checkpoint(run_dir)
    if path is None:
        raise CommandError(f"--resume {run_dir}: the run has no complete checkpoint (checkpoint.every was 0, or it "
                        "stopped before the first one); start it again instead")
    several_machines = int(os.environ.get("WORLD_SIZE", "1")) > int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    step = verify_checkpoint(path, model_shapes(backbone.model), elsewhere_ok=several_machines)
    saved = make_paths_absolute(load_config(run_dir / "config.toml")).model_dump(mode="json")  # older runs: relative
    changed = unsafe_changes(saved, config.model_dump(mode="json"))
    if changed:
        raise CommandError(f"--resume {run_dir}: the config differs from the run's in what a resumed run must keep: "
                        + "; ".join(changed) + ". Use the run's config (its config.toml), or start a new run")
    if step >= config.train.max_steps and not config.train.epochs:  # epochs: steps known once the data is read
        raise CommandError(f"--resume {run_dir}: the checkpoint is at step {step}, train.max_steps is "
                        f"{config.train.max_steps}; raise it to train on (--set train.max_steps=N)")
    print(f"resuming {run_dir} from {path} (step {step})", flush=True)


def train_command(args) -> None:
    """Check, prepare the run folder, start the processes, and after them plot the loss and draw the samples."""
    from ..distributed import launch
    from ..train.worker import train_worker

    config, run_dir, is_main, lock = _prepare_run(args)
    try:
        launch(train_worker, (config.model_dump(mode="json"), str(run_dir), bool(args.resume)), config.world_size)
        if is_main:
            _finish(config, run_dir)
    finally:
        if lock is not None:
            lock.release()


def _finish(config, run_dir: Path) -> None:
    from ..data.sources import source_of
    from ..grids import save_grid
    from ..sampling import grid_controls, grid_prompts, load_generator
    from ..train.records import plot_loss

    plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
    if config.output.sample_every_end and config.output.save_weights and source_of(config).samples:
        gen = load_generator(run_dir)
        seeds = config.sample.seeds
        columns = grid_prompts(config, lambda: _folder_captions(config))
        prompts = [p for _ in seeds for p in columns]
        row_seeds = [s for s in seeds for _ in columns]
        controls = grid_controls(config)
        images = gen.generate(prompts, row_seeds, config.sample.steps, config.sample.guidance_scale,
                              controls=[c for _ in seeds for c in controls] if controls else None)
        written = save_grid(images, len(seeds), run_dir / "samples.png", columns, [f"seed {s}" for s in seeds])
        print(f"samples: {written}", flush=True)
    print(f"done: {run_dir}", flush=True)


def _folder_captions(config) -> list[str]:
    from ..data.folder import Skipped, scan_folders
    from ..data.images import data_folders

    return [item.caption for item in scan_folders(data_folders(config.data), 0, Skipped())]
