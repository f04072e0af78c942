"""Scalar and image sinks: TensorBoard (torch.utils.tensorboard) and, when installed and enabled, Weights & Biases."""
from __future__ import annotations

from pathlib import Path

from ..config import RunConfig

__all__ = ["ScalarWriters", "make_writers"]


class _Wandb:
    def __init__(self, config: RunConfig, run_dir: Path):
        import wandb  # optional dependency: enabled only by observe.wandb = true

        self._wandb = wandb
        self._run = wandb.init(dir=str(run_dir), config=config.model_dump(mode="json"), name=run_dir.name)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._run.log({tag: value}, step=step)

    def add_image(self, tag: str, path: Path, step: int) -> None:
        self._run.log({tag: self._wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        self._run.finish()


class ScalarWriters:
    """Fans scalars out to every enabled sink."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for sink in self.sinks:
            sink.add_scalar(tag, value, step)

    def add_image(self, tag: str, path: Path, step: int) -> None:
        """An image file (a PNG of samples) under `tag`."""
        import numpy as np
        from PIL import Image

        pixels = np.asarray(Image.open(path).convert("RGB"))
        for sink in self.sinks:
            if isinstance(sink, _Wandb):
                sink.add_image(tag, path, step)
            else:
                sink.add_image(tag, pixels, step, dataformats="HWC")

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def make_writers(config: RunConfig, run_dir: Path) -> ScalarWriters:
    sinks = []
    if config.observe.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        sinks.append(SummaryWriter(log_dir=str(run_dir / "tensorboard")))
    if config.observe.wandb:
        sinks.append(_Wandb(config, run_dir))
    return ScalarWriters(sinks)
