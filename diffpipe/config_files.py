"""A config file read: TOML parsed, `--set section.key=value` overrides applied, validated (config.py's schema), the
names the registries own checked (`REGISTRY_KEYS`: data sources, schedules, families) with the checks that need
them (a data source's own, a schedule's stage and micro-batch counts), and what the model folder decides filled in:
a pipeline folder names its backbone's class, so its family (model.architecture), and its scheduler the objective
(train.objective), when the config leaves them unset.

    config = load_config("examples/digits.toml", ["train.max_steps=10"])
"""
from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any, Callable

from .config import RunConfig, validate_config
from .errors import ArchitectureError, CheckpointError, ConfigError
from .written_files import RUN_MARK
from .models.folder import is_pipeline_folder, pipeline_index
from .models.registry import BUILTIN_FAMILIES, family_for
from .data.sources import SOURCES
from .pipeline.schedules import SCHEDULES

__all__ = ["load_config", "build_config", "load_run_config", "REGISTRY_KEYS"]

# config keys whose values a registry names: the registry owns the names (the schema takes a string), so a new
# data source, schedule or family is one registry line; config_reference lists them as each key's choices
REGISTRY_KEYS: dict[tuple[str, str], Callable[[], dict]] = {
    ("model", "architecture"): lambda: BUILTIN_FAMILIES,
    ("data", "dataset"): lambda: SOURCES,
    ("pipeline", "schedule"): lambda: SCHEDULES,
}


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """The config in TOML file `path`, with `overrides` applied, validated and resolved against its model folder."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file; give a TOML config such as examples/digits.toml") from None
    return build_config(data, overrides)


def load_run_config(run_dir: Path) -> RunConfig:
    """The config a run folder holds: a folder whose config.toml is not a run's (a project's own) and that diffpipe
    did not mark is said not to be a run folder, rather than reported as a config with unknown keys."""
    try:
        return load_config(Path(run_dir) / "config.toml")
    except ConfigError:
        if (Path(run_dir) / RUN_MARK).is_file():
            raise
        raise ConfigError(f"{run_dir} is not a run folder: diffpipe did not make it (no {RUN_MARK}) and its "
                          "config.toml is not a run's; give the folder `diffpipe train` wrote (its output.dir)") from None


def build_config(data: dict[str, Any], overrides: list[str] = ()) -> RunConfig:
    """A config mapping with `overrides` applied, validated and resolved against its model folder."""
    config = validate_config(data, overrides)
    _check_names(config)
    try:
        _check_across_rooms(config)
    except ValueError as exc:
        raise ConfigError(f"invalid config:\n  {exc}") from None
    _resolve_architecture(config)
    _resolve_objective(config)
    return config


def _check_names(config: RunConfig) -> None:
    """Each of REGISTRY_KEYS names an entry of its registry (model.architecture may instead name "module:Class")."""
    for (section, key), registry in REGISTRY_KEYS.items():
        value, names = getattr(getattr(config, section), key), list(registry())
        if value in names or (key == "architecture" and ":" in value):
            continue
        close = difflib.get_close_matches(value, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        custom = ", or a ModelFamily subclass as \"package.module:Class\"" if key == "architecture" else ""
        raise ConfigError(f"invalid config:\n  {section}.{key}: {value!r} is not one of {', '.join(names)}"
                          f"{custom}{hint}")


def _check_across_rooms(config: RunConfig) -> None:
    """The checks that need a registry's entry: the data source's (its keys, its held-out data), the schedule's
    (stages, virtual stages and micro-batches it can run)."""
    p = config.pipeline
    SOURCES[config.data.dataset].check_data(config.data)
    problem = SCHEDULES[p.schedule].problem(p.stages, p.virtual_stages, p.microbatches)
    if problem:
        raise ValueError(problem)
    if SCHEDULES[p.schedule].zero_bubble and p.compile:
        # the split backward starts its weight pass at autograd's nodes inside the stage; a compiled graph is one
        # node, which neither torch's split nor diffpipe's check of it (pipeline/zero_bubble.py) sees into
        raise ValueError(f"pipeline.schedule = {p.schedule!r} (zero bubble) with pipeline.compile = {p.compile!r} "
                         "is not supported; set pipeline.compile = false, or use schedule 1f1b / interleaved_1f1b")
    SOURCES[config.data.dataset].check_config(config)


def _resolve_architecture(config: RunConfig) -> None:
    """A pipeline folder names its backbone's class (model_index.json): model.architecture unset, that class's family
    is used; set to another family, the run is refused before anything loads."""
    folder = config.model.pipeline_folder()
    if config.model.components is not None and not is_pipeline_folder(folder):
        raise ConfigError(f"model.components = {config.model.components!r} is not a diffusers pipeline folder (no "
                          "model_index.json there): name the folder holding vae/, the text encoders and scheduler/")
    if folder is None:
        return
    index = pipeline_index(folder)
    classes = {entry[1] for key, entry in index.items() if key in ("unet", "transformer") and isinstance(entry, list)}
    families = {name for name in BUILTIN_FAMILIES if family_for(name).model_class.__name__ in classes}
    if config.model.architecture in families and family_for(config.model.architecture).trains_folder(index):
        return  # set to a family of the folder's backbone class that trains such folders (TI2V-5B's: wan_i2v too)
    if len(families) > 1:  # one backbone class, several families (Flux, Flux Kontext): the pipeline's class decides
        families = {name for name in families if index.get("_class_name") in family_for(name).pipelines} or families
    if len(families) != 1 or config.model.architecture in families:
        return
    (found,) = families
    if "architecture" not in config.model.model_fields_set:
        config.model.architecture = found
        return
    raise ConfigError(f"model.architecture = {config.model.architecture!r} but {folder} is a "
                      f"{index.get('_class_name', 'pipeline')} folder whose backbone is {' '.join(classes)} "
                      f"(architecture {found!r}); set model.architecture = \"{found}\" or leave it out")


def _resolve_objective(config: RunConfig) -> None:
    """train.objective unset: the pipeline folder's scheduler decides (through the model's family), else the family's
    default (flow matching). Then what the objective rules out (min-SNR weighting of flow matching)."""
    if config.train.objective is None:
        try:
            family = family_for(config.model.architecture)
            folder = config.model.pipeline_folder()
            config.train.objective = family.objective_of_folder(folder) if folder else family.default_objective
        except (CheckpointError, ArchitectureError) as exc:
            raise ConfigError(str(exc)) from None
    if config.train.min_snr_gamma and config.train.objective == "flow_matching":
        raise ConfigError(f"train.min_snr_gamma = {config.train.min_snr_gamma}: min-SNR weighting is defined for "
                          "epsilon and v-prediction models (SD 1.x/2.x, SDXL), and this run trains flow matching; flow "
                          "matching weighs timesteps by how it samples them (train.timestep_sampling)")

