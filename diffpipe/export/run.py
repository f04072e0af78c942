"""A finished run's export: the run folder checked, the target checked, the format's writer called.

Reads the run folder's files, written on rank 0 at the end of training (weights sent over the process group, so a
run over several machines needs no shared disk): `model.safetensors` (with LoRA, the base with the adapters merged
in), `lora.safetensors` (the adapters), `model_config.json` and `config.toml`. An existing --out is refused unless
--force, and then only what an earlier export wrote (a folder it marked, a .safetensors file whose header names it:
written_files.check_target); it is replaced whole once the new export is written. No run's files, nor its base model
(model.path), ever. Files get the user's umask.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from ..config import RunConfig
from ..config_files import load_run_config
from ..errors import CommandError, ExportError
from ..models.family import ModelFamily
from ..models.lora import adapted_module, is_adapter
from ..models.registry import family_for
from ..written_files import check_target, give_user_mode, mark_export, written_by_export
from . import FORMATS

__all__ = ["ExportedRun", "export_run", "prepare_export", "export_files", "format_writer", "replacing",
           "one_file", "only_unets"]


@dataclass(frozen=True)
class ExportedRun:
    folder: Path
    config: RunConfig
    family: ModelFamily
    model_config: dict  # the backbone's diffusers config (model_config.json)
    adapted: tuple[str, ...] | None = None  # the modules given adapters, before lora.safetensors exists (at launch)

    @property
    def lora(self) -> bool:
        return self.config.adapter.type != "none"

    def adapted_modules(self) -> list[str]:
        """The modules given LoRA adapters (`transformer_blocks.0.attn.to_q`), from lora.safetensors' names (none
        before the file is written: the export checks again once it is)."""
        if self.adapted is not None:
            return sorted(self.adapted)
        if not (self.folder / "lora.safetensors").is_file():
            return []
        with safe_open(str(self.folder / "lora.safetensors"), framework="pt") as f:
            return sorted({adapted_module(k) for k in f.keys() if is_adapter(k)})


def export_run(run_dir: Path, fmt: str, out: Path, force: bool = False) -> Path:
    """Writes the export of a finished run (refusing an existing `out` unless `force`, and ever the run's or its base
    model's own files); returns the path written. `out` ending in .safetensors is one file, in every format."""
    config, writer, out = prepare_export(run_dir, fmt, out, force)
    return export_files(run_dir, config, writer, out)


def prepare_export(run_dir: Path, fmt: str, out: Path, force: bool, finished: bool = True):
    """(the run's config, the format's writer module, the target as the format names it), after checking the run
    folder (`finished`: its final weights are there) and the target."""
    needed = ("config.toml", "model.safetensors", "model_config.json") if finished else ("config.toml",)
    for name in needed:
        if not (run_dir / name).is_file():
            raise ExportError(f"{run_dir} is not a finished run folder: {name} is missing")
    writer = format_writer(fmt)
    out = writer.target(out)
    config = load_run_config(run_dir)
    _check_target(out, run_dir, config.model.path, force)
    return config, writer, out


def format_writer(fmt: str):
    """The module under export/ that writes format `fmt` (its target, check and write)."""
    return importlib.import_module(f"{__package__}.{FORMATS[fmt]}")


def export_files(folder: Path, config: RunConfig, writer, out: Path) -> Path:
    """The export of the weight files in `folder` as a run writes them (model.safetensors, lora.safetensors,
    model_config.json): the run's own, or those made from a checkpoint or during training."""
    for name in ("model.safetensors", "lora.safetensors"):
        _check_readable(folder / name)
    run = ExportedRun(folder, config, family_for(config.model.architecture),
                      json.loads((folder / "model_config.json").read_text()))
    if config.model.expert == "both" and not getattr(writer, "WRITES_TWO_EXPERTS", False):
        raise ExportError(f"{folder} trained both experts of {config.model.path} (model.expert = \"both\"): "
                          "--format diffusers writes them (a pipeline folder with both subfolders, or a LoRA file for "
                          "each); other formats hold one backbone")
    writer.check(run)
    return writer.write(run, out)


def _check_target(out: Path, run_dir: Path, base_model: str | None, force: bool) -> None:
    """Refuse to write over any run's files or this run's base model, over anything that exists without --force,
    and with it over anything an earlier export did not write (written_files.check_target)."""
    protected = [("the run folder", run_dir)] + ([("the run's base model (model.path)", Path(base_model))]
                                                  if base_model else [])
    folder_over_file = out.suffix != ".safetensors" and out.is_file()  # refused below, naming why
    try:
        check_target(out, force, lambda p: folder_over_file or written_by_export(p),
                     "an earlier export (a folder with its .diffpipe-export mark, or a .safetensors file diffpipe "
                     "exported)", protected)
    except CommandError as exc:
        raise ExportError(str(exc)) from None
    if folder_over_file:
        raise ExportError(f"--out {out} is a file, and this export is a folder; name a folder, or a .safetensors file")


def _check_readable(path: Path) -> None:
    if not path.is_file():
        return
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise ExportError(f"{path} is damaged ({exc}); export an earlier copy, or train the run again") from None


def replacing(out: Path, write, fmt: str) -> Path:
    """`write(folder)` into a new folder beside `out`, marked as an export of format `fmt`, which then replaces `out`
    whole (nothing half-written)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        write(partial)
        mark_export(partial, fmt)
        give_user_mode(partial)
        if out.is_dir():
            shutil.rmtree(out)
        os.replace(partial, out)
    finally:
        if partial.exists():
            shutil.rmtree(partial)
    return out


def one_file(out: Path) -> Path:
    """`out` as a .safetensors file: what loaders recognise (diffusers would try a pickle)."""
    return out if out.suffix == ".safetensors" else out.with_name(out.name + ".safetensors")


def only_unets(run: ExportedRun, fmt: str) -> None:
    """Refuse a format that holds UNet layouts only for a run of another family."""
    if run.family.name != "unet2d":
        raise ExportError(f"--format {fmt} writes UNet layouts, and {run.folder} trained a {run.family.name} model; "
                          "use --format comfyui (ComfyUI's LoRA loader) or diffusers (diffusers' own loaders)")
