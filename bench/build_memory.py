"""Host memory and time a process spends building its part of the model: the whole backbone (one process, or
the unsplit reference) against each stage of the planned split built alone, as each pipeline process does.

    python bench/build_memory.py examples/sdxl_unet.toml [--stages 4] [--no-whole] [--set KEY=VALUE ...]
    python bench/build_memory.py examples/sdxl_unet.toml --stages 1 --set adapter.type='"lora"' [--device cpu]

--no-whole skips the whole model, for one larger than this machine's memory (examples/sdxl_wide_unet.toml: 36 GiB).
--device: the device kind the processes would train on, which decides how frozen weights are stored
(memory.base_dtype = "auto": bf16 for LoRA on cuda under autocast); they are cast module by module as built.

Each build runs in a fresh process; prints one JSON line per build: the units it holds, the seconds it took and
the process's peak resident memory above what it held after the imports.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2**30


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _build(config_path: str, sets: list[str], units: list[int] | None, device_kind: str) -> dict:
    from diffpipe.build import build_backbone, give_weights
    from diffpipe.config_files import load_config
    from diffpipe.precision import frozen_storage

    config = load_config(config_path, sets)
    before = _peak_bytes()
    start = time.perf_counter()
    backbone = build_backbone(config, "meta")
    give_weights(backbone, config, units, frozen=frozen_storage(config, device_kind))
    held = sum(p.numel() * p.element_size() for p in backbone.model.parameters() if not p.is_meta)
    return {"seconds": round(time.perf_counter() - start, 1), "weights_gib": round(held / GIB, 2),
            "peak_rss_gib_above_imports": round((_peak_bytes() - before) / GIB, 2)}


def _in_fresh_process(*args) -> dict:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_build, *args).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--no-whole", action="store_true", help="build only the stages, not the whole model")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="the device kind trained on")
    args = parser.parse_args()
    from diffpipe.build import build_backbone
    from diffpipe.config_files import load_config
    from diffpipe.pipeline.split import stage_specs
    from diffpipe.planner.plan import resolve_stages

    sets = [*args.set, f"pipeline.stages={args.stages}"]
    config = load_config(args.config, sets)
    meta = build_backbone(config, "meta")
    split, _ = resolve_stages(config, meta)
    if not args.no_whole:
        print(json.dumps({"what": "whole model", **_in_fresh_process(args.config, sets, None, args.device)}), flush=True)
    for spec in stage_specs(meta, split):
        units = list(range(spec.first, spec.last))
        print(json.dumps({"what": f"stage {spec.index}", "units": f"{meta.units[spec.first].name}.."
                          f"{meta.units[spec.last - 1].name}", **_in_fresh_process(args.config, sets, units, args.device)}),
              flush=True)


if __name__ == "__main__":
    main()
