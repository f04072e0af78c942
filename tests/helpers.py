"""Shared test helpers: running a function on several real processes (gloo on CPU), and `diffpipe` commands in
this process."""
from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from diffpipe.cli import main
from diffpipe.distributed import launch


def run_workers(fn: Callable, args: tuple, world_size: int) -> None:
    """fn(*args) on `world_size` processes started as `diffpipe train` starts them, each with RANK/WORLD_SIZE set as torchrun would."""
    launch(fn, args, world_size)


@dataclass
class Ran:
    returncode: int
    stdout: str  # what this process printed: the launcher's lines (the plan, the data, resuming) and a one-process run's
    stderr: str = "(in this process: its errors are in pytest's captured output)"


def losses_of(run) -> list[float]:
    """Each step's loss of a finished run folder (its metrics.jsonl)."""
    import json
    from pathlib import Path

    return [json.loads(line)["loss"] for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def grid_size(columns: int, rows: int, tile: tuple[int, int], seeds: list[int]) -> tuple[int, int]:
    """The size of a labelled grid of samples (diffpipe/grids.py): tiles of `tile` pixels (as enlarged) with each
    column's prompt above and each row's "seed N" at its left."""
    from diffpipe.grids import grid_layout

    return grid_layout(tile, columns, rows, [f"seed {s}" for s in seeds]).size


def run_command(args: list[str]) -> Ran:
    """`diffpipe ARGS` through the CLI's own entry point, in this process: the same code as the command line less a
    new interpreter and its imports, and, for several processes, forked from one fork server that pytest's process
    keeps (about 9 s saved a run on 2 cores, one process or two: tests/test_export.py). For what only its own process shows
    (signals, exit codes of the interpreter, the workers' printed lines) tests run `python -m diffpipe`.
    The environment and folder are restored afterwards: a one-process run sets RANK, WORLD_SIZE and MASTER_ADDR
    as torchrun would, which would make the next command think it runs under torchrun."""
    environment, folder = dict(os.environ), os.getcwd()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = main(args)
    finally:
        if dist.is_initialized():  # a one-process run that failed leaves its group
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
        os.chdir(folder)
    print(out.getvalue())  # shown by pytest when the test fails
    return Ran(code, out.getvalue())


def example_module(name: str):
    """A script of examples/ (not part of the package) imported as a module: `example_module("digits_quality")`."""
    import importlib.util
    import sys
    from pathlib import Path

    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def wan_output(transformer):
    """A Wan transformer's output on two fixed clips of 4 frames of 8x8 latents (its config's widths), one near the
    start of sampling and one near its end: for comparing a loaded export with the trained model."""
    import torch

    cfg = transformer.config
    gen = torch.Generator().manual_seed(0)
    clips = torch.randn(2, cfg.in_channels, 4, 8, 8, generator=gen)
    text = torch.randn(2, 8, cfg.text_dim, generator=gen)
    with torch.no_grad():
        return transformer.eval()(hidden_states=clips, timestep=torch.tensor([500, 20]),
                                  encoder_hidden_states=text).sample


def check_diffusers_lora(pipeline_class, folder, run, out, predict, load=None) -> None:
    """A run's LoRA exported with `diffpipe export --format diffusers` loads through `pipeline_class`'s
    `load_lora_weights` (or `load(pipe, file)`, where the pipeline has none) into the trained output:
    `predict(transformer)` of the base with the file loaded equals that of the base with the run's adapters merged
    (its model.safetensors), and differs from the base's alone."""
    import torch
    from safetensors.torch import load_file

    trained = pipeline_class.from_pretrained(folder).transformer
    trained.load_state_dict(load_file(str(run / "model.safetensors")))
    want = predict(trained)
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    pipe = pipeline_class.from_pretrained(folder)
    base = predict(pipe.transformer)
    (load or type(pipe).load_lora_weights)(pipe, out / "pytorch_lora_weights.safetensors")
    assert (base - want).abs().max() > 1e-3  # the adapters matter
    torch.testing.assert_close(predict(pipe.transformer), want, rtol=1e-5, atol=1e-5)


def check_comfyui_lora(pipeline_class, folder, run, out, predict, to_release, from_release) -> None:
    """A run's LoRA exported with `diffpipe export --format comfyui` for a family whose ComfyUI model is its release's
    (FLUX.2's BFL names, LTX-2's Lightricks'), loaded as ComfyUI loads it: every weight of the model under
    `diffusion_model.` and its own name (comfy/lora.py `model_lora_keys_unet`'s generic map), `W += alpha / rank *
    up @ down` (alpha 1 per rank without an `.alpha`). The base's weights go to the release's names
    (`to_release`), take the patches, and come back by diffusers' own reader of the release (`from_release`); the
    output equals the trained model's (its model.safetensors) and no key is left unloaded."""
    import torch
    from safetensors.torch import load_file

    trained = pipeline_class.from_pretrained(folder).transformer
    trained.load_state_dict(load_file(str(run / "model.safetensors")))
    want = predict(trained)
    assert main(["export", str(run), "--format", "comfyui", "--out", str(out)]) == 0
    lora = load_file(str(out))
    base = pipeline_class.from_pretrained(folder).transformer
    release = to_release({k: v.float().clone() for k, v in base.state_dict().items()})
    loaded = set()
    for key in [k for k in lora if k.endswith(".lora_down.weight")]:
        x = key.removesuffix(".lora_down.weight")
        weight = release[x.removeprefix("diffusion_model.") + ".weight"]
        up, down = lora[f"{x}.lora_up.weight"].float(), lora[key].float()
        alpha = lora[f"{x}.alpha"].item() / down.shape[0] if f"{x}.alpha" in lora else 1.0
        weight += alpha * (up.flatten(1) @ down.flatten(1)).reshape(weight.shape)
        loaded |= {key, f"{x}.lora_up.weight", f"{x}.alpha"}
    assert set(lora) - loaded == set(), sorted(set(lora) - loaded)[:5]
    base.load_state_dict(from_release(release))
    torch.testing.assert_close(predict(base), want, rtol=1e-5, atol=1e-5)


EDIT_QUICK = ["--set", "output.sample_every_end=false", "--set", "checkpoint.every=0", "--set", "observe.log_every=0",
              "--set", "train.warmup_steps=0", "--set", "data.caption_dropout=0.0"]


def train_edit_example(example: str, model_folder, tiny, out, *extra: str) -> Ran:
    """`diffpipe train examples/EXAMPLE.toml` of an edit model on the tiny edits (tiny/edits: pictures and their grey
    controls) with `model_folder`, quickly (no samples, checkpoints or warmup; captions kept), plus `extra`."""
    from pathlib import Path

    edits = Path(tiny) / "edits"
    return run_command(["train", str(Path(__file__).parent.parent / "examples" / f"{example}.toml"),
                        "--output-dir", str(out), "--set", f'model.path="{model_folder}"',
                        "--set", f'data.path="{edits / "pictures"}"', "--set", f'data.control_path="{edits / "controls"}"',
                        "--set", f'data.cache_dir="{Path(out).parent / "cache"}"', *EDIT_QUICK, *extra])


def check_edit_lora(example: str, pipeline_class, model_folder, tiny, tmp_path, predict) -> None:
    """An edit example trained 4 steps as a rank-4 LoRA on one stage (`train_edit_example`) exports for diffusers
    and loads into `pipeline_class` with the trained output (`check_diffusers_lora`)."""
    run = tmp_path / "lora"
    result = train_edit_example(example, model_folder, tiny, run, "--set", "train.max_steps=4",
                                "--set", "train.learning_rate=1e-2", "--set", "pipeline.stages=1",
                                "--set", 'adapter.type="lora"', "--set", "adapter.rank=4", "--set", "adapter.alpha=8.0")
    assert result.returncode == 0, result.stdout[-3000:]
    check_diffusers_lora(pipeline_class, model_folder, run, tmp_path / "out", predict)


def trains_alike_on_one_and_two_stages(train: Callable[..., Ran], tmp_path, steps: int = 6,
                                       weights_atol: float = 1e-6) -> None:
    """`train(out, *args)` (a `diffpipe train` of an example with `args` added) on 1 and on 2 stages, captions kept:
    the same losses (rtol 1e-5, fp32) and the same merged weights (rtol 1e-4, atol `weights_atol`)."""
    import torch
    from safetensors.torch import load_file

    runs, losses = {}, {}
    for stages in (1, 2):
        runs[stages] = tmp_path / f"stages{stages}"
        result = train(runs[stages], "--set", f"train.max_steps={steps}", "--set", f"pipeline.stages={stages}",
                       "--set", "data.caption_dropout=0.0")
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"{stages} stage(s)" in result.stdout
        losses[stages] = losses_of(runs[stages])
    assert len(losses[1]) == steps and all(loss == loss for loss in losses[1])
    torch.testing.assert_close(torch.tensor(losses[2]), torch.tensor(losses[1]), rtol=1e-5, atol=0)
    merged = [load_file(str(runs[s] / "model.safetensors")) for s in (1, 2)]
    for name, tensor in merged[0].items():
        torch.testing.assert_close(merged[1][name], tensor, rtol=1e-4, atol=weights_atol, msg=name)


def predicted_with_padded_text(family, transformer, text_width: int):
    """The diffusers forward (`family.diffusers_forward`) of two random 16 x 12 latents of 4 channels beside random
    texts of 512 positions, the first filled for 20 and the second for 9 (zero after, as captions are padded): a
    `predict` for `check_diffusers_lora` of a family that cuts and masks its text (Qwen-Image, Chroma)."""
    import torch

    from diffpipe.models.family import Feed

    gen = torch.Generator().manual_seed(0)
    feed = Feed(family, transformer.config)
    hidden = torch.randn(2, 512, text_width, generator=gen)
    hidden[0, 20:], hidden[1, 9:] = 0, 0
    with torch.no_grad():
        conditions = dict(feed.conditions(hidden, torch.zeros(2, 0), torch.zeros(2, 6), (16, 12)),
                          timestep=torch.tensor([500.0, 20.0]))
        return family.diffusers_forward(transformer.eval(), feed.pack(torch.randn(2, 4, 16, 12, generator=gen)),
                                        conditions)


def photos_with_long_captions(tiny, out, *patterns: str):
    """A copy of the tiny photos in `out` whose captions matching `patterns` are their caption eight times over (a
    bucket of long captions: its steps cut the text to more positions than the others')."""
    import shutil

    photos = shutil.copytree(tiny / "photos", out / "photos")
    for pattern in patterns:
        for caption in photos.glob(pattern):
            caption.write_text(" ".join([caption.read_text().strip()] * 8))
    return photos
