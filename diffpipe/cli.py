"""The `diffpipe` command.

    diffpipe train examples/digits.toml [--set train.max_steps=50] [--output-dir runs/x] [--overwrite]
    diffpipe train examples/digits.toml --resume runs/digits [--set pipeline.stages=4]  # from its last checkpoint
    diffpipe plan examples/sdxl_unet.toml --set pipeline.stages=4 [--world-size 8] [--gpu-memory 80GiB] [--json]
        [--profile] [--probe | --probe-unsplit]
    diffpipe timeline runs/digits [--step N] --out timeline.png
    diffpipe report runs/digits
    diffpipe serve runs/digits [--port 8000]                          # the run in a browser, updating as it trains
    diffpipe sample runs/digits --prompt "a handwritten digit seven" --num 8 --seed 0 --steps 30 --out seven.png
    diffpipe cache examples/photos.toml [--processes N]               # image folders: latents and text ahead
    diffpipe export runs/photos --format diffusers|comfyui|kohya|original --out PATH  # [--step N] [--force]
    diffpipe config [--markdown]                                      # every config key, its default and help
    torchrun --nnodes 2 --nproc-per-node 4 ... -m diffpipe train CONFIG   # multi-node: one process per GPU

`train` starts pipeline.stages x pipeline.data_parallel processes itself unless torchrun already did.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .errors import CommandError  # these two import nothing: `diffpipe --help` stays instant
from .export import FORMATS

__all__ = ["main"]


def _train(args) -> None:
    from .commands.train import train_command

    train_command(args)


def _sample(args) -> None:
    from .commands.sample import sample_command

    sample_command(args)


def _cache(args) -> None:
    from .commands.cache import cache_command

    if args.processes < 1:
        raise CommandError(f"--processes {args.processes}: give 1 or more")
    cache_command(args.config, args.set or [], args.processes)


def _export(args) -> None:
    from .commands.export import export_command

    written = export_command(Path(args.run_dir), args.format, Path(args.out), args.force, args.step)
    print(f"wrote {written}")


def _plan(args) -> None:
    from .config_files import load_config
    from .commands.plan import plan_command

    config = load_config(args.config, args.set or [])
    plan_command(config, args.world_size, args.gpu_memory, args.json, args.profile, args.probe, args.probe_unsplit,
                 args.explain)


def _timeline(args) -> None:
    from .commands.observe import timeline_command

    timeline_command(args.run_dir, args.step, args.out, args.force)


def _report(args) -> None:
    from .commands.observe import report_command

    report_command(args.run_dir, args.out, args.force)


def _serve(args) -> None:
    from .commands.serve import serve_command

    serve_command(args.run_dir, args.host, args.port)


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
    plan.add_argument("--explain", action="store_true",
                      help="say why this layout won: its split against the parameter-count split, the stages it "
                           "checkpoints, and with --world-size every other layout tried and why it lost")
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
    timeline.add_argument("--force", action="store_true", help="replace an earlier picture and trace at --out")
    timeline.set_defaults(run=_timeline)
    report = sub.add_parser("report", help="one-page summary of a run (text and PNG)")
    report.add_argument("run_dir")
    report.add_argument("--out", default=None, help="PNG path (default RUN_DIR/report.png)")
    report.add_argument("--force", action="store_true", help="replace an existing picture at --out")
    report.set_defaults(run=_report)
    serve = sub.add_parser("serve", help="a run's loss, samples, stage times and timeline as a local web page, "
                                         "updating while it trains")
    serve.add_argument("run_dir")
    serve.add_argument("--port", type=int, default=8000, help="port to serve on (default 8000)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                          "only; 0.0.0.0: every network, no password)")
    serve.set_defaults(run=_serve)
    sample = sub.add_parser("sample", help="generate images from a finished run")
    sample.add_argument("run_dir")
    sample.add_argument("--prompt", required=True)
    sample.add_argument("--num", type=int, default=1)
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--steps", type=int, default=None)
    sample.add_argument("--guidance", type=float, default=None, help="classifier-free guidance scale")
    sample.add_argument("--control", default=None,
                        help="an edit model (flux_kontext, qwen_image_edit): the image to edit; an image-to-video "
                        "model (wan_i2v): the first frame (an image, or a video's first frame)")
    sample.add_argument("--out", required=True)
    sample.add_argument("--force", action="store_true",
                        help="replace an existing image at --out (never a run's own files)")
    sample.set_defaults(run=_sample)
    export = sub.add_parser("export", help="a finished run's weights for diffusers, ComfyUI, A1111 or kohya's tools")
    export.add_argument("run_dir")
    export.add_argument("--format", required=True, choices=list(FORMATS),
                        help="diffusers: a pipeline folder (full) or LoRA file (diffusers' loaders); comfyui: a LoRA "
                             "of any family in ComfyUI's names (its LoRA loader); kohya: a UNet LoRA for "
                             "ComfyUI/A1111/kohya's tools; original: the UNet as one file in the original layout")
    export.add_argument("--out", required=True, help="folder (diffusers) or .safetensors file")
    export.add_argument("--force", action="store_true",
                        help="replace an earlier export at --out (never anything else: a run's files, your folders)")
    export.add_argument("--step", type=int, help="export the run's checkpoint after this step instead of its final "
                                                 "weights (the run may still be training)")
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
    except (DiffpipeError, FileNotFoundError) as exc:
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
