"""Computed-once tensors on disk (VAE latents, text-encoder outputs) in safetensors shards, by key.

Each shard `NAME.safetensors` is sealed by `NAME.json`, written after it: the shard's sha256, the keys it holds and
the keys that could not be computed (a broken image) with the reason. A shard without a seal (a build that was
stopped) is ignored; a shard whose bytes do not match its seal, that safetensors cannot read, or whose seal is
damaged, is named in a warning, removed with its seal and its entries computed again: never trained on. Keys are
fingerprints of everything an entry depends on (data/images.py), so a changed input or model simply misses, and
several processes can build one store at once, each writing its own shards.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from ..errors import DataError

__all__ = ["ShardStore", "fill_store", "Entries"]

Entries = dict[str, dict[str, torch.Tensor]]  # key -> named tensors


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _well_formed(seal) -> bool:
    """A seal as `write` makes it: a JSON object with a list of keys and a map of failures."""
    return (isinstance(seal, dict) and isinstance(seal.get("keys", []), list)
            and all(isinstance(k, str) for k in seal.get("keys", []))
            and isinstance(seal.get("failed", {}), dict) and isinstance(seal.get("sha256"), (str, type(None))))


class ShardStore:
    def __init__(self, folder: Path):
        self.folder = folder

    def _read_seals(self) -> tuple[dict[Path, dict], list[str]]:
        """The sound seals by path, and a line for each damaged one (or one of another shape), naming its shard.
        A seal being written is a dot-file until whole (`write`): never read."""
        seals, damaged = {}, []
        for path in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []:
            if path.name.startswith("."):
                continue
            try:
                seal = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError, OSError):
                seal = None
            if _well_formed(seal):
                seals[path] = seal
            else:
                damaged.append(f"{path.with_suffix('.safetensors')}: its seal {path.name} is damaged")
        return seals, damaged

    def _seals(self) -> dict[Path, dict]:
        return self._read_seals()[0]

    def damaged_seals(self) -> list[str]:
        """A line for each shard whose seal is damaged (`remove` takes them)."""
        return self._read_seals()[1]

    def known(self) -> tuple[set[str], dict[str, str]]:
        """Keys held by sealed shards, and keys that failed (with the reason), from the seals alone."""
        keys, failed = set(), {}
        for seal in self._seals().values():
            keys.update(seal.get("keys", []))
            failed.update(seal.get("failed", {}))
        return keys, failed

    def write(self, entries: Entries, failed: dict[str, str]) -> Path | None:
        """One new shard of `entries` (and the keys that failed), sealed; None when there is nothing to write."""
        if not entries and not failed:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        shard = self.folder / f"{name}.safetensors"
        flat = {f"{key}/{tensor}": value.contiguous().cpu() for key, named in entries.items()
                for tensor, value in named.items()}
        if flat:
            save_file(flat, str(shard))
        seal = {"sha256": _sha256(shard.read_bytes()) if flat else None, "keys": sorted(entries), "failed": failed}
        temporary = self.folder / f".{name}.json"
        temporary.write_text(json.dumps(seal))
        temporary.rename(self.folder / f"{name}.json")
        return shard

    def load(self, wanted: set[str]) -> tuple[Entries, list[str]]:
        """The wanted entries found in sound shards, and a line for each damaged shard (whose entries are missing)."""
        found: Entries = {}
        damaged = []
        for seal_path, seal in self._seals().items():
            if not wanted & set(seal.get("keys", [])):
                continue
            shard = seal_path.with_suffix(".safetensors")
            try:
                data = shard.read_bytes()
                if _sha256(data) != seal.get("sha256"):
                    raise ValueError("its bytes do not match the sha256 in its seal")
                tensors = load(data)
            except (OSError, ValueError, SafetensorError) as exc:
                damaged.append(f"{shard}: {exc}")
                continue
            for flat, value in tensors.items():
                key, name = flat.split("/", 1)
                if key in wanted:
                    found.setdefault(key, {})[name] = value
        return found, damaged

    def remove(self, damaged: list[str]) -> None:
        for line in damaged:
            shard = Path(line.split(": ", 1)[0])
            shard.with_suffix(".json").unlink(missing_ok=True)
            shard.unlink(missing_ok=True)


def fill_store(store: ShardStore, wanted: list[str], compute: Callable[[list[str]], tuple[Entries, dict[str, str]]],
               rank: int = 0, world: int = 1, barrier: Callable[[], None] = lambda: None,
               warn: Callable[[str], None] = print) -> tuple[Entries, dict[str, str]]:
    """Every wanted entry, computed (this process's share of the missing ones) and written first where the store
    lacks it; returns (entries, failed keys with their reasons). Every process returns the same."""
    wanted_set = set(wanted)
    if rank == 0:  # a damaged seal's shard cannot be trusted: its entries are computed again below
        _discard(store, store.damaged_seals(), warn)
    barrier()
    for attempt in range(2):
        have, failed = store.known()
        missing = [k for k in wanted if k not in have and k not in failed]
        barrier()  # every process has listed what is missing before any writes: the shares below then agree
        mine = missing[rank::world]
        if mine:
            store.write(*compute(mine))
        barrier()
        entries, damaged = store.load(wanted_set)
        failed = {k: why for k, why in store.known()[1].items() if k in wanted_set}
        barrier()  # every process has read before a damaged shard is removed
        if not damaged and wanted_set <= set(entries) | set(failed):
            return entries, failed
        if rank == 0:
            _discard(store, damaged, warn)
        barrier()
    raise DataError(f"the cache in {store.folder} is still incomplete or damaged after a rebuild; check the disk "
                    "and that every process sees the same cache folder (data.cache_dir)")


def _discard(store: ShardStore, damaged: list[str], warn: Callable[[str], None]) -> None:
    """Name each damaged shard in a warning and remove it with its seal."""
    for line in damaged:
        warn(f"warning: damaged cache shard {line}; removed, its entries are computed again")
    store.remove(damaged)
