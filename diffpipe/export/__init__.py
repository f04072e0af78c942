"""`diffpipe export RUN_DIR --format FORMAT [--out PATH] [--force]`: a finished run's weights in the layouts other
tools load, one module per format (export/diffusers.py, kohya.py, comfyui.py, original.py), the run's checks and the writing
that replaces a target whole in export/run.py.

    diffpipe export runs/photos --format diffusers --out photos_pipeline   # full: a diffusers folder
    diffpipe export runs/lora --format diffusers --out lora_diffusers      # LoRA: pipe.load_lora_weights(folder)
    diffpipe export runs/lora --format kohya --out lora_kohya.safetensors  # LoRA: ComfyUI, A1111, kohya's tools
    diffpipe export runs/lora --format comfyui --out lora.safetensors      # LoRA of any family: ComfyUI's names
    diffpipe export runs/photos --format original --out unet.safetensors   # the UNet in the original (SGM) layout
    diffpipe export runs/photos --format diffusers --out unet.safetensors  # the backbone alone, diffusers' names

This module imports nothing, so that the CLI's parser reads the format names from here before torch loads.
A new format: a module here with `check(run)` and `write(run, out)`, and its name in `FORMATS`.
"""
from __future__ import annotations

__all__ = ["FORMATS"]

# format -> its module under diffpipe/export/ (export/run.py imports the one asked for)
FORMATS = {"diffusers": "diffusers", "kohya": "kohya", "comfyui": "comfyui", "original": "original"}
