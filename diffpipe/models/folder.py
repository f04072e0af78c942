"""A local diffusers pipeline folder: model_index.json beside unet/, vae/, text_encoder/, tokenizer/, scheduler/ (and
for SDXL text_encoder_2/, tokenizer_2/), as `save_pretrained` writes it and the Hub serves it.

Reading a folder, and nothing more (a leaf of models/: it imports no other module of the package): which files and
subfolders it has, what its model_index.json and scheduler say, its tokenizers. The backbone is loaded by
loading.py, the VAE by vae.py, the text encoders by each family's text module; weights are read from safetensors
files only (`component_weights` refuses pickle-only components unread).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import CheckpointError

__all__ = ["is_pipeline_folder", "pipeline_index", "has_component", "expert_boundary", "component_weights",
           "load_tokenizer", "scheduler_objective", "fingerprint_files", "caption_tokens", "text_encoder_configs",
           "PICKLE_SUFFIXES"]

_INDEX = "model_index.json"
PICKLE_SUFFIXES = (".ckpt", ".bin", ".pt", ".pth", ".pkl")


def is_pipeline_folder(path: str | Path | None) -> bool:
    return path is not None and (Path(path) / _INDEX).is_file()


def pipeline_index(folder: Path) -> dict:
    """The folder's model_index.json: the pipeline's class and each component's (library, class)."""
    return json.loads((folder / _INDEX).read_text())


def has_component(folder: Path, component: str) -> bool:
    entry = pipeline_index(folder).get(component)
    return isinstance(entry, list) and entry[0] is not None and (folder / component).is_dir()


def expert_boundary(folder: Path) -> float | None:
    """A two-expert pipeline's switch (Wan 2.2: model_index.json's boundary_ratio, with transformer_2/ beside
    transformer/): `transformer` denoises t >= it, `transformer_2` below; None for a one-backbone pipeline."""
    ratio = pipeline_index(folder).get("boundary_ratio")
    return float(ratio) if ratio is not None and has_component(folder, "transformer_2") else None


def dynamic_shift(folder: Path) -> tuple[int, int, float, float] | None:
    """(base tokens, max tokens, base shift, max shift) of a folder's flow-matching scheduler that shifts by
    resolution (use_dynamic_shifting: Flux's, Qwen-Image's), the scheduler's defaults filling what it leaves out;
    None for one that does not."""
    path = folder / "scheduler" / "scheduler_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    if not cfg.get("use_dynamic_shifting"):
        return None
    return (cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
            cfg.get("max_shift", 1.15))


def scheduler_objective(folder: Path) -> str:
    """The objective the folder's scheduler was trained with: its prediction_type, on the schedule diffpipe uses."""
    path = folder / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        raise CheckpointError(f"model.path={folder}: no scheduler/scheduler_config.json; set train.objective")
    cfg = json.loads(path.read_text())
    objective = cfg.get("prediction_type", "epsilon")
    if objective not in ("epsilon", "v_prediction"):
        raise CheckpointError(f"{path}: prediction_type {objective!r} is not supported; set train.objective to "
                              "epsilon, v_prediction or flow_matching")
    schedule = (cfg.get("beta_schedule"), cfg.get("beta_start"), cfg.get("beta_end"), cfg.get("num_train_timesteps"))
    if schedule != ("scaled_linear", 0.00085, 0.012, 1000):
        raise CheckpointError(f"{path}: the noise schedule {schedule} (beta_schedule, beta_start, beta_end, "
                              "num_train_timesteps) is not Stable Diffusion's scaled_linear 0.00085..0.012 over 1000 "
                              "steps, the only one diffpipe trains with; set train.objective = \"flow_matching\" to "
                              "train on another path")
    return objective


def text_encoder_configs(folder: Path, names: tuple[str, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3")
                         ) -> list[dict]:
    """The config.json of each text encoder the folder has, in order."""
    return [json.loads((folder / name / "config.json").read_text()) for name in names
            if (folder / name / "config.json").is_file()]


def caption_tokens(folder: Path) -> int:
    """Tokens per caption of the folder's (first) tokenizer: 77 for CLIP."""
    cfg = json.loads((folder / "tokenizer" / "tokenizer_config.json").read_text())
    length = cfg.get("model_max_length", 77)
    return length if length <= 4096 else 77  # transformers writes 1e30 for "no limit"


def fingerprint_files(paths: list[Path], extra: str = "") -> str:
    """sha256 over the files' bytes (streamed) and `extra`: changes when any weight changes."""
    digest = hashlib.sha256(extra.encode())
    for path in sorted(paths):
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def component_weights(folder: Path, component: str) -> list[Path]:
    """The .safetensors files of a component subfolder; pickle-only components are refused unread."""
    sub = folder / component
    if not sub.is_dir():
        raise CheckpointError(f"model.path={folder}: the pipeline folder has no {component}/ subfolder")
    files = sorted(sub.glob("*.safetensors"))
    if files:
        plain = [f for f in files if ".fp16." not in f.name]  # a Hub 'variant' beside the full-precision files
        return plain or files
    pickles = sorted(p.name for p in sub.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{sub}: only pickle weight files ({', '.join(pickles)}), which can run code when loaded; "
                              "diffpipe reads only .safetensors: convert them with a trusted tool, or download the "
                              "safetensors files of the model")
    raise CheckpointError(f"{sub} holds no .safetensors weights")


def load_tokenizer(folder: Path, subfolder: str):
    """A pipeline folder's tokenizer: a missing or empty subfolder is named (transformers would fall back to
    another tokenizer class and ask to install sentencepiece)."""
    from transformers import AutoTokenizer

    sub = Path(folder) / subfolder
    if not sub.is_dir() or not any(sub.iterdir()):
        raise CheckpointError(f"model.path={folder}: the pipeline folder has no {subfolder}/ (or it is empty), which "
                              f"its text_encoder{subfolder.removeprefix('tokenizer')}/ needs; copy it from the model's "
                              "release")
    return AutoTokenizer.from_pretrained(folder, subfolder=subfolder, local_files_only=True)
