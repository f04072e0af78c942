"""How big is a checkpoint and how long does training pause to write and read it?

    python bench/checkpoint_io.py examples/sdxl_unet.toml [--background-only] [--set KEY=VALUE ...]

Builds the config's model as one stage on this device (a Trainer in this process), takes two training steps so
AdamW's state exists, then times the pause of a synchronous checkpoint (every tensor copied to the host, written
as safetensors, sealed with sha256), the pause of a background one (`checkpoint.asynchronous`: the copy to host
memory only) and how long it takes to be written and sealed while the next steps train, and `verify_checkpoint` +
`load_checkpoint`; prints one JSON line with the checkpoint's size and the times. Writes under a temporary folder
(or --out).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffpipe.config_files import load_config  # noqa: E402
from diffpipe.distributed import resolve_device_kind, single_process_topology  # noqa: E402
from diffpipe.train.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--out", default=None, help="folder for the checkpoint (default: a temporary one)")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--background-only", action="store_true", help="time only the background checkpoint")
    args = parser.parse_args()
    run_dir = Path(args.out or tempfile.mkdtemp())
    config = load_config(args.config, ["pipeline.stages=1", "train.max_steps=1000", "observe.enabled=false",
                                       "output.save_weights=false", "output.sample_every_end=false", *args.set])
    trainer = Trainer(config, single_process_topology(resolve_device_kind(config.train.device)), run_dir)
    for step in range(2):
        trainer.steps.take(step)
    device = trainer.topo.device
    if args.background_only:
        _background(trainer, args.config, device)
        return
    _sync(device)
    start = time.perf_counter()
    path = save_checkpoint(trainer, 2, keep=1)
    _sync(device)
    saved = time.perf_counter() - start
    size = sum(f.stat().st_size for f in path.iterdir())
    start = time.perf_counter()
    verify_checkpoint(path, trainer.model_shapes)
    verified = time.perf_counter() - start
    start = time.perf_counter()
    load_checkpoint(trainer, path)
    _sync(device)
    loaded = time.perf_counter() - start
    shutil.rmtree(path)  # room on the disk for the next one
    print(json.dumps({"config": args.config, "device": str(device), "checkpoint_GiB": round(size / 2**30, 3),
                      "save_s": round(saved, 2), "verify_sha256_s": round(verified, 2), "load_s": round(loaded, 2)}),
          flush=True)  # kept if the background part below runs out of host memory (it did for SDXL on 125 GiB)
    _background(trainer, args.config, device)
    if args.out is None:
        shutil.rmtree(run_dir)


def _background(trainer, config: str, device: torch.device) -> None:
    """The pause of a background checkpoint (the copy to host memory), and how long it takes to be written and
    sealed while training goes on; the steps' own time without it for comparison."""
    _sync(device)
    start = time.perf_counter()
    trainer.steps.take(2)
    _sync(device)
    step_s = time.perf_counter() - start
    background = torch.distributed.new_group(backend="gloo")
    start = time.perf_counter()
    pending = save_checkpoint(trainer, 3, keep=1, background_group=background)
    paused = time.perf_counter() - start
    steps_meanwhile = 0
    while not pending.future.done():
        trainer.steps.take(3 + steps_meanwhile)
        steps_meanwhile += 1
    _sync(device)
    trained = time.perf_counter() - start - paused
    path = pending.finish()
    written = time.perf_counter() - start
    size = sum(f.stat().st_size for f in path.iterdir())
    params = sum(p.numel() for p in trainer.params)
    print(json.dumps({"config": config, "device": str(device), "parameters_M": round(params / 1e6, 1),
                      "checkpoint_GiB": round(size / 2**30, 3), "files": len(list(path.iterdir())),
                      "step_s": round(step_s, 3), "background_pause_s": round(paused, 2),
                      "background_written_and_sealed_s": round(written, 2), "steps_trained_meanwhile": steps_meanwhile,
                      "step_s_meanwhile": round(trained / max(steps_meanwhile, 1), 3)}), flush=True)


if __name__ == "__main__":
    main()
