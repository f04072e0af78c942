"""The central test: pipelined training computes what the unsplit diffusers model computes.

Real processes (gloo, CPU). The reference (reference_loop.py) shares no code with diffpipe but the model adapter
under test: the diffusers model's own forward (`UNet2DConditionModel`, `FluxTransformer2DModel`,
`SD3Transformer2DModel`, ...: `ModelFamily.diffusers_forward`; train mode, autograd) in one process, noisy inputs and
targets from diffusers' schedulers, text from transformers' CLIP, LoRA from peft, torch's AdamW, `clip_grad_norm_`
and schedule; only the random numbers (items, captions, timesteps, noise, LoRA's first A) come from diffpipe's data
code (`draws_of`). Its initial weights are saved with `save_pretrained` and the pipeline reads them through
`model.path`, its text encoder through `model.text_encoder`. For every schedule offered, at 2 and 4 stages, with data
parallel x pipeline (3 micro-batches on 2 stages; the replicas on torch's `replicate` and on `fully_shard`, which cuts
weights, gradients and AdamW state across them), with clipping on and off, weight decay and a logit-normal timestep
density, for a digits and a tiny SDXL-style UNet, for Flux and SD3 made for digits (every schedule at 2 and 4
stages, and dp2 x pp2), and for LoRA (peft's layers on the frozen model, the reference injecting them into its whole
UNet), these must agree:
- every step's loss, and the logged gradient norm (before clipping);
- every parameter's gradient of the first step's mean loss, before clipping and before the optimizer, in
  magnitude (AdamW ignores a uniform scale of its input, so the weights alone would not catch one);
- AdamW's moments after the last step: the optimizer's actual input, clip factor included;
- the weights after the last step.
A NaN or inf anywhere fails. `test_planted_errors_fail_the_comparison` shows each check failing on a planted error.

Tolerance: every difference is measured relative to the largest magnitude of the tensor compared. In fp32 the
pipeline runs the same operations on the same micro-batches; what differs is the order in which gradients are
summed (micro-batches, replicas, stages' norms), a rounding of about 1e-7 relative per addition. Measured worst
cases: losses 1.5e-7, norms 1.1e-6, gradients 6.5e-6; the bound is 1e-4, far under any real error (a missing
micro-batch or replica division is 0.5 or more, a dropped micro-batch about 0.25). AdamW's moments after the last
step hold the later steps' gradients, which the first step's roundings have moved: for most models 1.5e-5 apart, but
Wan 2.1 I2V's cross-attention key biases (and their norm's weights) are sums that cancel, and their moments drift
1.0e-4 (1F1B) and 5.3e-4 (sequence parallel) of their own size on an AVX2 CPU (under 1e-4 on the AVX-512 ones
measured before). That is rounding: the unsplit model run twice, its initial weights one float32 rounding apart
(x (1 +- 2^-24) each), differs by 1.1e-4 in the same moment (`python -m tests.pipeline.rounding_drift
wan21-i2v-1f1b-2`). So moments are bound at 2e-3, 18x that drift and still
more than 100x under a real error (a doubled moment is 1.0). Weights are
compared against lr x steps, the furthest AdamW moves a weight: an element whose gradient is near Adam's epsilon
turns a rounding-sized gradient difference into a visible update difference (measured worst 3.2e-3 of lr x
steps); the bound, 2e-2, is far under a wrong learning rate or schedule step (0.17 and more here).

bf16 and fp16 (autocast; fp16 with the dynamic loss scale 2^16 on both sides): the pipeline and the reference run
the same autocast operations on the same tensors, so the same bound applies. Measured rounding of bf16 itself:
the unsplit model under bf16 autocast on 1 and on 2 threads (oneDNN reduces in another order) differs by 2.1e-2
in gradients, 1.1e-3 in the gradient norm and 1.1e-4 in the loss; against the fp32 model, 4.1e-2 in gradients.
On the same thread count, the pipelined bf16 gradients equal the unsplit ones exactly (0.0). So the reference runs
with the workers' one thread, the bound stays 1e-4, and a pipeline that lost its autocast fails it by 400x.
fp16 is compared over one step (its gradients too are exactly equal): after the first update the two optimizers
(fused AdamW unscaling inside its kernel; GradScaler's unscale_, then clipping) leave weights a float32 rounding
apart, and the next fp16 forward turns some of those into fp16 roundings (measured after 3 steps: moments 1.5e-3,
the size of fp16's 2^-11), which is the optimizers' rounding, not the pipeline's.

AdamW's epsilon is 1e-6 here: with 1e-8, Adam divides gradients of ~1e-9 by their own root-mean-square, so
rounding in the order gradients are summed would decide the sign of a whole learning-rate-sized update.
Scenarios of one world size share one launch (a launch costs ~10 s here).
"""
from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from safetensors.torch import load_file

import pytest
import torch

from diffpipe.build import build_backbone, sample_shape, timestep_range
from diffpipe.config_files import build_config
from diffpipe.data import make_dataset
from diffpipe.data.batches import BatchMaker
from diffpipe.data.moving_digits import MOTION_WORDS
from diffpipe.data.sources import source_of
from diffpipe.models.lora import add_lora, is_adapter
from diffpipe.models.families.flux.chroma import CHROMA_PRESETS
from diffpipe.models.families.flux.flux import FLUX_PRESETS
from diffpipe.models.families.hunyuan_video15.hunyuan_video15 import HUNYUAN_VIDEO15_PRESETS
from diffpipe.models.families.unet.presets import UNET_PRESETS
from diffpipe.models.registry import family_for
from diffpipe.models.text import TextEncoder
from diffpipe.pipeline.data_parallel import full
from diffpipe.pipeline.schedules import schedule_named
from diffpipe.planner.plan import hardware, make_plan, unit_costs
from diffpipe.models.families.sd3.sd3 import SD3_PRESETS
from diffpipe.models.families.qwen_image.qwen_image import QWEN_IMAGE_PRESETS
from diffpipe.models.families.z_image.z_image import Z_IMAGE_PRESETS
from diffpipe.models.families.flux2.flux2 import FLUX2_PRESETS
from diffpipe.models.families.ltx2.ltx2 import LTX2_PRESETS
from diffpipe.models.families.unet.unet3d import UNET3D_PRESETS
from diffpipe.models.families.wan.wan import WAN_PRESETS
from diffpipe.models.families.wan.i2v import WAN_I2V_PRESETS
from diffpipe.torch_support import schedule_problem

from ..helpers import run_workers
from ..models.test_unet_units import SDXL_STYLE
from .reference_loop import OPTIMIZER_STATE, Draws, StepDraw, reference

STEPS = 3
REL_TOL = 1e-4
TOLERANCES = {"losses": REL_TOL, "grad_norms": REL_TOL, "grads": REL_TOL, "moments": 2e-3, "weights": 2e-2}
CHECKS = ("losses", "grad_norms", "grads", "moments", "weights")


MODELS = {"digits": ("unet2d", UNET_PRESETS["digits"]), "sdxl-style": ("unet2d", SDXL_STYLE),
          "flux": ("flux", FLUX_PRESETS["digits"]), "chroma": ("chroma", CHROMA_PRESETS["digits"]),
          "sd3": ("sd3", SD3_PRESETS["digits"]),
          "toy-tied": ("tests.models.toy_family:ToyFamily", {}),  # a norm tied between the first and last units
          "wan": ("wan", WAN_PRESETS["digits"]),  # clips of moving digits
          "wan-i2v": ("wan_i2v", WAN_I2V_PRESETS["digits"]),  # each clip's first frame beside its noisy latents
          "wan-ti2v-i2v": ("wan_i2v", WAN_I2V_PRESETS["digits-ti2v"]),  # TI2V's: the first frame replaced, at t = 0
          "wan21-i2v": ("wan_i2v", WAN_I2V_PRESETS["digits-clip"]),  # Wan 2.1 I2V's: a picture embedding before the text
          "unet3d": ("unet3d", UNET3D_PRESETS["digits"]),
          "qwen-image": ("qwen_image", QWEN_IMAGE_PRESETS["digits"]),
          "flux-kontext": ("flux_kontext", FLUX_PRESETS["digits"]),  # synthetic latents, each with a control
          "qwen-image-edit": ("qwen_image_edit", QWEN_IMAGE_PRESETS["digits"]),
          "hunyuan-video15": ("hunyuan_video15", HUNYUAN_VIDEO15_PRESETS["digits"]),
          "z-image": ("z_image", Z_IMAGE_PRESETS["digits"]),  # reversed time and prediction; per-sample rotary tables
          "flux2": ("flux2", FLUX2_PRESETS["digits"]),  # modulations computed once and sent on; 4-axis rotary
          # video and audio streams, the audio's tokens after the video's in one sample; synthetic clips
          "ltx2": ("ltx2", LTX2_PRESETS["digits"])}


MOVING = ("wan", "wan-i2v", "wan-ti2v-i2v", "wan21-i2v", "unet3d", "hunyuan-video15")  # trained on clips of moving digits
SYNTHETIC = ("sdxl-style", "flux-kontext", "qwen-image-edit", "ltx2")  # trained on synthetic latents (an edit model: with random controls)
TEXT_LENGTH = 8


def _config(stages: int, schedule: str, virtual: int = 1, dp: int = 1, microbatches: int = 4,
            checkpointing="none", model: str = "digits", clip: float = 1.0, precision: str = "fp32",
            steps: int = STEPS, lora: bool | str = False, shard: bool = False, weight_decay: float = 0.0,
            timesteps: str = "uniform", optimizer: str = "adamw", optimizer_args: dict | None = None,
            learning_rate: float = 1e-3, timestep_range: list[float] | None = None, sp: int = 1) -> dict:
    digits = model not in SYNTHETIC  # the others are made for 1-channel 8x8 images
    micro_size = 2 if digits else 1
    return {
        "adapter": {"type": lora if isinstance(lora, str) else "lora", "rank": 4, "alpha": 8.0} if lora else {"type": "none"},
        # path and text_encoder: the folders of `model_folders`
        "model": {"path": model, "architecture": MODELS[model][0], "text_encoder": f"{model}-text",
                  "text_max_length": TEXT_LENGTH},
        "data": {"dataset": "moving_digits" if model in MOVING else "synthetic" if model in SYNTHETIC else "digits"},
        "train": {"max_steps": steps, "batch_size": micro_size * dp * microbatches, "learning_rate": learning_rate,
                  "optimizer": optimizer, "optimizer_args": optimizer_args or {},
                  "dropout": False,  # the spatio-temporal UNet drops 10 %: masks drawn per process cannot match
                  "warmup_steps": 1, "adam_eps": 1e-6, "max_grad_norm": clip, "seed": 3,
                  "timestep_sampling": timesteps, "precision": precision, "weight_decay": weight_decay,
                  "timestep_range": timestep_range},
        "pipeline": {"stages": stages, "schedule": schedule, "virtual_stages": virtual, "data_parallel": dp,
                     "data_parallel_shard": shard, "microbatches": microbatches, "checkpointing": checkpointing,
                     "sequence_parallel": sp},
    }


def _partly(config: dict, recomputed: list[int]) -> dict:
    """`config` with the last `recomputed[i]` units of stage i checkpointed."""
    config["pipeline"]["recomputed_units"] = recomputed
    return config


def _odd_tokens(config: dict, latent_size: list[int], frames: int | None = None) -> dict:
    """`config` on synthetic latents of `latent_size` (and `frames`): a picture token count that sequence parallel
    degrees do not divide."""
    config["data"] = {"dataset": "synthetic", "latent_size": latent_size, **({"frames": frames} if frames else {})}
    return config


TWO = {
    "gpipe-2": _config(2, "gpipe"),
    "1f1b-2": _config(2, "1f1b"),
    "1f1b-2-no-clipping": _config(2, "1f1b", clip=0.0),
    # AdamW's decoupled weight decay (torch's default 0.01 slipping in was caught only by chance) and a non-uniform
    # timestep density, both against torch's AdamW in the reference
    "1f1b-2-weight-decay-logit-normal": _config(2, "1f1b", weight_decay=0.1, timesteps="logit_normal"),
    "interleaved-2x2": _config(2, "interleaved_1f1b", virtual=2),
    "1f1b-2-checkpointed": _config(2, "1f1b", checkpointing="all"),
    # part of each stage checkpointed (pipeline.recomputed_units: its last units), as "auto" chooses near the memory
    "flux-1f1b-2-partly-checkpointed": _partly(_config(2, "1f1b", model="flux"), [2, 1]),
    "sdxl-style-1f1b-2": _config(2, "1f1b", model="sdxl-style"),
    "lora-1f1b-2": _config(2, "1f1b", lora=True),
    "flux-gpipe-2": _config(2, "gpipe", model="flux"),
    "flux-1f1b-2": _config(2, "1f1b", model="flux"),
    "flux-interleaved-2x2": _config(2, "interleaved_1f1b", virtual=2, model="flux"),
    "sd3-gpipe-2": _config(2, "gpipe", model="sd3"),
    "sd3-1f1b-2": _config(2, "1f1b", model="sd3"),
    "sd3-interleaved-2x2": _config(2, "interleaved_1f1b", virtual=2, model="sd3"),
    "qwen-image-1f1b-2": _config(2, "1f1b", model="qwen-image"),
    "qwen-image-lora-interleaved-2x2": _config(2, "interleaved_1f1b", virtual=2, model="qwen-image", lora=True),
    "z-image-1f1b-2": _config(2, "1f1b", model="z-image"),
    "z-image-lora-interleaved-2x2": _config(2, "interleaved_1f1b", virtual=2, model="z-image", lora=True),
    "flux2-1f1b-2": _config(2, "1f1b", model="flux2"),
    "flux2-lora-interleaved-2x2": _config(2, "interleaved_1f1b", virtual=2, model="flux2", lora=True),
    "ltx2-1f1b-2": _config(2, "1f1b", model="ltx2"),
    "toy-tied-1f1b-2": _config(2, "1f1b", model="toy-tied"),
    "toy-tied-interleaved-2x2": _config(2, "interleaved_1f1b", virtual=2, model="toy-tied"),
    "wan-gpipe-2": _config(2, "gpipe", model="wan"),
    "wan-1f1b-2": _config(2, "1f1b", model="wan"),
    "wan-1f1b-2-checkpointed": _config(2, "1f1b", model="wan", checkpointing="all"),
    # a Wan 2.2 low-noise expert's side of the boundary (train.timestep_range, as model.expert sets it): the run's
    # batches draw from the cut density as the reference's do
    "wan-1f1b-2-low-noise-side": _config(2, "1f1b", model="wan", timesteps="shift", timestep_range=[0.0, 0.875]),
    "wan-interleaved-2x2": _config(2, "interleaved_1f1b", virtual=2, model="wan"),
    "unet3d-1f1b-2": _config(2, "1f1b", model="unet3d"),
    "unet3d-interleaved-2x2": _config(2, "interleaved_1f1b", virtual=2, model="unet3d"),
    # zero-bubble schedules: 4 stages on 2 processes (V-shaped for zbv and dualpipev)
    "zb1p-2x2": _config(2, "zb1p", virtual=2),
    "zbv-2x2": _config(2, "zbv", virtual=2),
    "dualpipev-2x2-checkpointed": _config(2, "dualpipev", virtual=2, checkpointing="all"),
    "flux-zbv-2x2": _config(2, "zbv", virtual=2, model="flux"),
    "sd3-zb1p-2x2": _config(2, "zb1p", virtual=2, model="sd3"),
    "wan-dualpipev-2x2": _config(2, "dualpipev", virtual=2, model="wan"),
    "unet3d-zbv-2x2": _config(2, "zbv", virtual=2, model="unet3d"),
    "toy-tied-zbv-2x2": _config(2, "zbv", virtual=2, model="toy-tied"),  # the tied weight's stages on one process
    "lora-zb1p-2x2": _config(2, "zb1p", virtual=2, lora=True),
    # peft's other adapters (adapter.type): DoRA's magnitude, LoHa's and LoKr's factors, against peft's on the unsplit
    "dora-1f1b-2": _config(2, "1f1b", lora="dora"),
    "loha-1f1b-2-checkpointed": _config(2, "1f1b", lora="loha", checkpointing="all"),
    "lokr-interleaved-2x2": _config(2, "interleaved_1f1b", virtual=2, lora="lokr"),
    # Prodigy's step size from sums over every stage's weights, a tied weight counted once (against prodigyopt's
    # Prodigy on the unsplit model; d0 raised so that its steps move the weights within 3 steps), and Adafactor
    "prodigy-toy-tied-1f1b-2": _config(2, "1f1b", model="toy-tied", optimizer="prodigy", learning_rate=1.0,
                                       weight_decay=0.01, steps=6),
    "prodigy-lora-interleaved-2x2": _config(2, "interleaved_1f1b", virtual=2, lora=True, optimizer="prodigy",
                                            learning_rate=1.0, optimizer_args={"use_bias_correction": True}, steps=6),
    "adafactor-sdxl-style-1f1b-2": _config(2, "1f1b", model="sdxl-style", optimizer="adafactor", weight_decay=0.01),
    "adafactor-lora-1f1b-2-first-moment": _config(2, "1f1b", lora=True, optimizer="adafactor",
                                                  optimizer_args={"beta1": 0.9}),
    "adafactor-dp2": _config(1, "1f1b", dp=2, optimizer="adafactor"),  # torch's DDP engine: plain tensors
    # data parallel alone, on torch's DDP engine (replicated) and fully_shard; every family replicated, since DDP
    # refuses a step where a trained parameter got no gradient
    "dp2": _config(1, "1f1b", dp=2),
    "lora-dp2-checkpointed": _config(1, "1f1b", dp=2, lora=True, checkpointing="all"),
    "flux-dp2": _config(1, "1f1b", dp=2, model="flux"),
    "sd3-dp2": _config(1, "1f1b", dp=2, model="sd3"),
    "wan-dp2": _config(1, "1f1b", dp=2, model="wan"),
    # Qwen-Image's last block leaves its text side unused (no gradient): data parallel must not wait for one
    "qwen-image-dp2": _config(1, "1f1b", dp=2, model="qwen-image"),
    "chroma-1f1b-2": _config(2, "1f1b", model="chroma"),
    "wan-i2v-1f1b-2": _config(2, "1f1b", model="wan-i2v"),
    "wan-ti2v-i2v-1f1b-2": _config(2, "1f1b", model="wan-ti2v-i2v"),  # timesteps and modulations per latent frame
    "wan21-i2v-1f1b-2": _config(2, "1f1b", model="wan21-i2v"),  # the picture's tokens cross the boundary in `context`
    # two text masks, the last block's text side left out, the modulation rows and the joined tokens across stages
    "hunyuan-video15-1f1b-2": _config(2, "1f1b", model="hunyuan-video15"),
    "flux-kontext-1f1b-2": _config(2, "1f1b", model="flux-kontext"),  # each item's control tokens beside its own
    "qwen-image-edit-1f1b-2": _config(2, "1f1b", model="qwen-image-edit"),
    "unet3d-dp2": _config(1, "1f1b", dp=2, model="unet3d"),
    "sdxl-style-dp2": _config(1, "1f1b", dp=2, model="sdxl-style"),
    "dp2-sharded-checkpointed": _config(1, "1f1b", dp=2, shard=True, checkpointing="all"),
    "lora-dp2-sharded": _config(1, "1f1b", dp=2, shard=True, lora=True),
    # each sample's tokens split over 2 processes (pipeline/sequence.py): Ulysses attention, the loss on each share
    "wan-sp2": _config(1, "1f1b", sp=2, model="wan"),
    "wan-lora-sp2-checkpointed": _config(1, "1f1b", sp=2, model="wan", lora=True, checkpointing="all"),
    # the frozen weights of 2 blocks in host memory, copied in as each computes (memory.block_swap)
    "wan-lora-sp2-swapped": {**_config(1, "1f1b", sp=2, model="wan", lora=True), "memory": {"block_swap": 2}},
    # joint attention: the text's tokens split beside the image's, the rotary table as both
    "flux-sp2": _config(1, "1f1b", sp=2, model="flux"),
    # image-to-video: the first frame joins along the channels; Wan 2.1's picture embedding in the cross-attention
    "wan-i2v-sp2": _config(1, "1f1b", sp=2, model="wan-i2v"),
    "wan21-i2v-sp2": _config(1, "1f1b", sp=2, model="wan21-i2v"),
    # the text's two parts split beside the video's, its masks and the rotary table cut to match where blocks read them
    "hunyuan-video15-sp2": _config(1, "1f1b", sp=2, model="hunyuan-video15"),
    # Qwen-Image's text mask and its two rotary tables (conditions) cut to match, the picture's by rows
    "qwen-image-sp2": _config(1, "1f1b", sp=2, model="qwen-image"),
    # 75 picture tokens over 2: the last share padded, the pad masked out of the keys and the loss
    "wan-sp2-padded": _odd_tokens(_config(1, "1f1b", sp=2, model="wan"), [10, 10], frames=3),
    "flux-sp2-padded": _odd_tokens(_config(1, "1f1b", sp=2, model="flux"), [6, 10]),  # 15 image tokens after the text
}
FOUR = {
    # 75 tokens over 4 processes (19 each, the last with one pad token); and across a stage boundary
    "wan-sp4-padded": _odd_tokens(_config(1, "1f1b", sp=4, model="wan"), [10, 10], frames=3),
    "flux-sp2-padded-x-1f1b-2": _odd_tokens(_config(2, "1f1b", sp=2, model="flux"), [6, 10]),
    # 2 heads over 4 processes: padded with 2 zero heads, each process attending with one (our own all-to-alls)
    "flux-sp4-padded-heads": _config(1, "1f1b", sp=4, model="flux"),
    # the same where the family attends through its own code (diffpipe's, beside the processor)
    "hunyuan-video15-sp4-padded-heads": _config(1, "1f1b", sp=4, model="hunyuan-video15"),
    "gpipe-4": _config(4, "gpipe"),
    "1f1b-4": _config(4, "1f1b"),
    "interleaved-4x2": _config(4, "interleaved_1f1b", virtual=2),
    "dp2-x-1f1b-2-3-microbatches": _config(2, "1f1b", dp=2, microbatches=3, clip=0.0),
    "dp2-sharded-x-1f1b-2-3-microbatches": _config(2, "1f1b", dp=2, microbatches=3, clip=0.0, shard=True),
    "sdxl-style-dp2-x-gpipe-2": _config(2, "gpipe", dp=2, model="sdxl-style"),
    "lora-dp2-sharded-x-1f1b-2": _config(2, "1f1b", dp=2, lora=True, shard=True),
    "flux-gpipe-4": _config(4, "gpipe", model="flux"),
    "flux-1f1b-4": _config(4, "1f1b", model="flux"),
    "flux-interleaved-4x2": _config(4, "interleaved_1f1b", virtual=2, model="flux"),
    "flux-dp2-sharded-x-1f1b-2": _config(2, "1f1b", dp=2, model="flux", shard=True),
    "sd3-gpipe-4": _config(4, "gpipe", model="sd3"),
    "sd3-1f1b-4": _config(4, "1f1b", model="sd3"),
    "sd3-interleaved-4x2": _config(4, "interleaved_1f1b", virtual=2, model="sd3"),
    "sd3-dp2-x-gpipe-2": _config(2, "gpipe", dp=2, model="sd3"),
    "toy-tied-gpipe-4": _config(4, "gpipe", model="toy-tied"),
    "toy-tied-dp2-x-1f1b-2": _config(2, "1f1b", dp=2, model="toy-tied"),
    "toy-tied-dp2-sharded-x-1f1b-2": _config(2, "1f1b", dp=2, model="toy-tied", shard=True),
    "wan-1f1b-4": _config(4, "1f1b", model="wan"),
    "wan-dp2-x-gpipe-2": _config(2, "gpipe", dp=2, model="wan"),
    "unet3d-gpipe-4": _config(4, "gpipe", model="unet3d"),
    "unet3d-dp2-x-1f1b-2": _config(2, "1f1b", dp=2, model="unet3d"),
    "zbv-4x2": _config(4, "zbv", virtual=2, microbatches=8),
    "flux-zb1p-4x2": _config(4, "zb1p", virtual=2, model="flux"),
    "sdxl-style-dp2-sharded-x-zbv-2x2": _config(2, "zbv", virtual=2, dp=2, model="sdxl-style", shard=True),
    # the replicas hold the same weights and gradients: Prodigy's sums are over the pipeline's processes alone
    "prodigy-dp2-x-1f1b-2": _config(2, "1f1b", dp=2, optimizer="prodigy", learning_rate=1.0, steps=6),
    # sequence parallel within a pipeline (the shares cross the stage boundary) and beside data parallel
    "wan-sp2-x-1f1b-2": _config(2, "1f1b", sp=2, model="wan"),
    "wan-sp2-x-dp2": _config(1, "1f1b", sp=2, dp=2, model="wan"),
    # the replicas' fully_shard over all four processes (data x sequence parallel): each holds a quarter
    "wan-sp2-x-dp2-sharded": _config(1, "1f1b", sp=2, dp=2, model="wan", shard=True),
    "flux-sp2-x-1f1b-2": _config(2, "1f1b", sp=2, model="flux"),
    "flux-sp2-x-dp2": _config(1, "1f1b", sp=2, dp=2, model="flux"),
    "hunyuan-video15-sp2-x-1f1b-2": _config(2, "1f1b", sp=2, model="hunyuan-video15"),
    "hunyuan-video15-sp2-x-dp2": _config(1, "1f1b", sp=2, dp=2, model="hunyuan-video15"),
}
# one step each: the first step's gradients are bit-equal and its weights within 1.5e-5 of lr, but bf16's rounding
# amplifies those last-bit differences of the optimizer's arithmetic (diffpipe scales the summed gradients once,
# the reference divides and clips) step by step: after 3 steps, moments 2e-2 apart on an AVX2 CPU (passing on an AVX-512
# one); several steps are compared in fp32 above
LOW_PRECISION = {
    "bf16-1f1b-2": _config(2, "1f1b", precision="bf16", steps=1),
    "fp16-1f1b-2": _config(2, "1f1b", precision="fp16", steps=1),
}


def write_model_folders(root: Path) -> dict[str, str]:
    """Each test model's initial weights, drawn by diffusers' own initialisation and saved as a diffusers folder
    (`NAME`), and a CLIP text encoder of the widths it reads as a transformers folder (`NAME-text`)."""
    folders = {}
    for name, (architecture, kwargs) in MODELS.items():
        torch.manual_seed(11)
        family = family_for(architecture)
        model = family.model_class(**kwargs)
        model.save_pretrained(root / name, safe_serialization=True)
        hidden, pooled = family.text_widths(model.config)
        words = MOTION_WORDS if name in MOVING else ()
        TextEncoder.tiny(hidden, max(pooled, 1), TEXT_LENGTH, seed=5, extra_words=words).save(root / f"{name}-text")
        folders.update({name: str(root / name), f"{name}-text": str(root / f"{name}-text")})
    return folders


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory) -> dict[str, str]:
    return write_model_folders(tmp_path_factory.mktemp("initial-weights"))


def resolved(data: dict, folders: dict[str, str]):
    data = copy.deepcopy(data)
    data["model"]["path"] = folders[data["model"]["path"]]
    data["model"]["text_encoder"] = folders[data["model"]["text_encoder"]]
    return build_config(data)


def planned_splits(configs: dict) -> None:
    """Each config's pipeline.split "auto" set to the planner's split here, once, as `diffpipe train` sets it before
    starting its processes (preflight.py), rather than by every process of every scenario: counting the units' costs
    takes a second or two a model on this CPU, and scenarios that differ only in their pipeline share the count."""
    counted = {}
    for config in configs.values():
        p = config.pipeline
        if p.split != "auto":
            continue
        key = json.dumps([config.model.model_dump(mode="json"), config.data.model_dump(mode="json"),
                          config.adapter.model_dump(mode="json"), config.memory.model_dump(mode="json"),
                          config.train.precision, config.train.device])
        if key not in counted:
            meta = build_backbone(config, "meta")
            counted[key] = meta, unit_costs(config, meta, 1)
        meta, per_sample = counted[key]
        plan = make_plan(config, meta, p.stages * p.virtual_stages, p.data_parallel, p.microbatches, hardware(config),
                         per_sample)
        p.split = plan.planned.starts


def _scenario_worker(scenarios: list[tuple[str, dict]], out_dir: str, device_kind: str = "cpu") -> None:
    """Each scenario trained for STEPS steps on this rank (gloo on CPU; NCCL on GPUs for bench/nccl_gradients.py):
    what `compare` checks, saved per rank."""
    from diffpipe.distributed import init_topology
    from diffpipe.train.records import read_record
    from diffpipe.train.trainer import Trainer

    if device_kind == "cuda":  # compare fp32 with fp32: cuDNN convolutions would otherwise round through TF32
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    for name, data in scenarios:
        config = build_config(data)
        topo = init_topology(config.pipeline.stages, config.pipeline.data_parallel, device_kind,
                             sp_size=config.pipeline.sequence_parallel)
        trainer = Trainer(config, topo, Path(out_dir))
        got = {"losses": [], "grad_norms": [], "grads": None, "skipped": []}
        for step in range(config.train.max_steps):
            loss, times = trainer.steps.forward_backward(step)
            if step == 0:
                got["grads"] = {n: g.cpu() for n, g in trainer.steps.batch_gradients().items()}
            record = read_record(trainer.steps.apply_gradients(step, loss, times))
            got["losses"].append(record["loss"])
            got["grad_norms"].append(record["grad_norm"])
            got["skipped"].append(record.get("skipped", False))
        named = [(n, p) for m in trainer.modules for n, p in m.full_named_parameters() if p.requires_grad]
        got["weights"] = {n: full(p.detach()).cpu() for n, p in named}  # whole, when replicas cut them
        got["moments"] = {f"{n}:{k}": full(trainer.optimizer.state[p][k]).cpu() for n, p in named
                          for k in OPTIMIZER_STATE[config.train.optimizer] if k in trainer.optimizer.state[p]}
        torch.save(got, os.path.join(out_dir, f"{name}-rank{topo.rank}.pt"))


def draws_of(config) -> Draws:
    """The run's random numbers, by diffpipe's own data code (they are numbers, not computations the reference
    checks): each step's items, captions after dropout, timesteps and noise (`BatchMaker.draw`), the clean items of
    data other than digits, and the LoRA adapters' first values (A seeded per module, B zero)."""
    meta = build_backbone(config, "meta")
    data = make_dataset(config.data.dataset, sample_shape(config, meta), config.train.seed,
                        source_of(config).has_controls(config, meta.family))
    maker = BatchMaker(data, None, config.train, config.data.caption_dropout, None,
                       timesteps_within=timestep_range(config))
    shape = tuple(data.x0([0]).shape[1:])
    steps = []
    for step in range(config.train.max_steps):
        drawn = maker.draw(step, shape)
        x0 = None if config.data.dataset == "digits" else data.x0(drawn.indices)
        steps.append(StepDraw(drawn.indices, drawn.captions, drawn.t, drawn.noise, x0,
                              data.control_latents(drawn.indices)))
    adapters = {}
    if config.adapter.type != "none":
        family = meta.family
        model = family.model_class.from_config(family.model_class.load_config(config.model.path))
        model.load_state_dict(load_file(str(Path(config.model.path) / "diffusion_pytorch_model.safetensors")))
        add_lora(model, config.adapter, family.lora_targets, config.train.seed)
        adapters = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter(n)}
    return Draws(steps, adapters)


# a gradient below float32's resolution of the largest of its kind is zero but for rounding (an attention key's bias
# without a norm after it: softmax ignores what it adds to a row): compared to that floor, not to its own noise
ROUNDING_ZERO = torch.finfo(torch.float32).eps


def _mismatch(got, want, scale: float | None = None, floor: float = 0.0) -> float:
    """Largest difference relative to `scale` (default: the largest magnitude of `want`, at least `floor`); inf for
    any NaN or inf."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    if got.shape != want.shape:
        return math.inf
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return math.inf
    scale = max(want.abs().max().item(), floor) if scale is None else scale
    diff = (got - want).abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def compare(ref: dict, ranks: list[dict], weight_scale: float) -> dict:
    """Worst relative difference of each check over every rank, where it was, and the parameters no rank held.
    Weights are compared relative to `weight_scale`, the furthest AdamW can move one in the run (lr x steps)."""
    worst = {key: (0.0, "") for key in CHECKS}
    floors = {key: _rounding_floors(ref[key] or {}) for key in ("grads", "moments")} | {"weights": {}}
    held = set()
    for rank, got in enumerate(ranks):
        # fp16: the same steps skipped for overflow (their norms are inf); every rank logs the all-reduced figures
        taken = [i for i, skipped in enumerate(ref["skipped"]) if not skipped]
        pairs = {"losses": (got["losses"], ref["losses"]),
                 "grad_norms": ([got["grad_norms"][i] for i in taken], [ref["grad_norms"][i] for i in taken])}
        for key, (mine, theirs) in pairs.items():
            found = _mismatch(mine, theirs) if got["skipped"] == ref["skipped"] else math.inf
            if not found <= worst[key][0]:  # `not <=`: a NaN is never within bounds
                worst[key] = (found, f"rank {rank}")
        for key in ("grads", "moments", "weights"):
            for name, value in got[key].items():
                scale = weight_scale if key == "weights" else None
                floor = floors[key].get(_kind(name), 0.0)
                found = _mismatch(value, ref[key][name], scale, floor) if name in ref[key] else math.inf
                if not found <= worst[key][0]:
                    worst[key] = (found, f"rank {rank} {name}")
        held |= set(got["grads"])
    return {"worst": worst, "missing": sorted(set(ref["grads"]) - held)}


def _kind(name: str) -> str:
    """What a reference tensor is: "" for a gradient, the optimizer moment's name ("exp_avg", "exp_avg_sq", ...)."""
    return name.rpartition(":")[2] if ":" in name else ""


def _rounding_floors(reference: dict) -> dict[str, float]:
    """ROUNDING_ZERO of the largest reference tensor of each kind (gradients; each optimizer moment apart, the second
    moments' squared)."""
    largest: dict[str, float] = {}
    for name, value in reference.items():
        kind = _kind(name)
        largest[kind] = max(largest.get(kind, 0.0), torch.as_tensor(value).abs().max().item())
    return {kind: top * ROUNDING_ZERO ** (2 if kind == "exp_avg_sq" else 1) for kind, top in largest.items()}


def failures(found: dict) -> list[str]:
    problems = [f"parameters without a gradient on any stage: {found['missing'][:3]}"] if found["missing"] else []
    for key, (value, where) in found["worst"].items():
        if not value <= TOLERANCES[key]:
            problems.append(f"{key} differ from the unsplit model's by {value:.2e} relative ({where})")
    return problems


def _weight_scale(config, ref: dict) -> float:
    return ref["step_size"] * config.train.max_steps


def _load_ranks(name: str, world: int, results_dir) -> list[dict]:
    return [torch.load(os.path.join(results_dir, f"{name}-rank{rank}.pt")) for rank in range(world)]


def _runs_on_this_torch(data: dict) -> bool:
    name = data["pipeline"]["schedule"]
    return schedule_problem(name, schedule_named(name).placement, "cpu") is None


# run again under each other tested torch (.ci/run): whole and split backwards, a V schedule, LoRA, data parallel,
# sequence parallel (whole and padded token counts; and heads padded, in test_sequence_parallel.py)
SMOKE = ("1f1b-2", "sdxl-style-1f1b-2", "zb1p-2x2", "zbv-2x2", "dualpipev-2x2-checkpointed", "flux-zbv-2x2",
         "lora-zb1p-2x2", "dp2", "dp2-sharded-checkpointed", "wan-sp2", "wan-sp2-padded")


@pytest.mark.parametrize("world,scenarios", [
    (2, {k: v for k, v in TWO.items() if k not in SMOKE}),
    # V-shaped schedules on gloo need torch 2.13 (torch_support.schedule_problem; refused before, and tested so)
    pytest.param(2, {k: TWO[k] for k in SMOKE if _runs_on_this_torch(TWO[k])}, marks=pytest.mark.torch_smoke),
    (4, FOUR)], ids=["2-processes", "2-processes-smoke", "4-processes"])
def test_pipelined_training_equals_the_unsplit_diffusers_model(world, scenarios, model_folders, tmp_path):
    configs = {name: resolved(data, model_folders) for name, data in scenarios.items()}
    planned_splits(configs)
    payload = [(name, cfg.model_dump(mode="json")) for name, cfg in configs.items()]
    run_workers(_scenario_worker, (payload, str(tmp_path)), world)
    problems = []
    for name, config in configs.items():
        ref = reference(config, draws_of(config))
        found = compare(ref, _load_ranks(name, world, tmp_path), _weight_scale(config, ref))
        print(name, {k: f"{v:.1e}" for k, (v, _) in found["worst"].items()}, "step size", ref["step_size"])
        problems += [f"{name}: {p}" for p in failures(found)]
    assert not problems, "\n".join(problems)


def test_low_precision_matches_unsplit_model_under_the_same_autocast(model_folders, tmp_path):
    configs = {name: resolved(data, model_folders) for name, data in LOW_PRECISION.items()}
    planned_splits(configs)
    payload = [(name, cfg.model_dump(mode="json")) for name, cfg in configs.items()]
    run_workers(_scenario_worker, (payload, str(tmp_path)), 2)
    for name, config in configs.items():
        ranks = _load_ranks(name, 2, tmp_path)
        draws = draws_of(config)
        ref = reference(config, draws)
        found = compare(ref, ranks, _weight_scale(config, ref))
        rounding = compare(reference(config, draws, autocast=torch.float32), ranks, _weight_scale(config, ref))  # what the rounding itself moves
        print(name, "pipeline vs unsplit:", {k: f"{v:.1e}" for k, (v, _) in found["worst"].items()},
              "vs unsplit in fp32:", {k: f"{v:.1e}" for k, (v, _) in rounding["worst"].items()})
        assert not failures(found), f"{name}: " + "; ".join(failures(found))
        assert rounding["worst"]["grads"][0] > 10 * REL_TOL  # the bound would see a lost autocast


def test_planted_errors_fail_the_comparison(model_folders):
    """The comparison itself, fed the reference as the result of a run and then with planted errors."""
    config = resolved(TWO["1f1b-2"], model_folders)
    ref = reference(config, draws_of(config))
    # clipping acts at every step of this scenario (and of those like it): torch's clip_grad_norm_ in the reference
    assert min(ref["grad_norms"]) > 2 * config.train.max_grad_norm
    assert not failures(compare(ref, [ref], _weight_scale(config, ref)))
    first = next(iter(ref["grads"]))

    def planted(change) -> list[str]:
        got = copy.deepcopy(ref)
        change(got)
        return failures(compare(ref, [got], _weight_scale(config, ref)))

    def scale_grads(got, by):
        got["grads"] = {n: g * by for n, g in got["grads"].items()}

    for by in (2.0, 0.5):  # a missing or doubled division by micro-batches or replicas
        assert any(p.startswith("grads") for p in planted(lambda got: scale_grads(got, by)))
    assert any(p.startswith("parameters without") for p in planted(lambda got: got["grads"].pop(first)))
    assert any(p.startswith("grads") for p in planted(lambda got: got["grads"][first].view(-1).__setitem__(0, math.nan)))
    assert any(p.startswith("losses") for p in planted(lambda got: got["losses"].__setitem__(1, math.nan)))
    assert any(p.startswith("losses") for p in planted(lambda got: got["losses"].__setitem__(2, got["losses"][2] * 1.01)))
    assert any(p.startswith("grad_norms") for p in planted(lambda got: got["grad_norms"].__setitem__(0, got["grad_norms"][0] * 2)))
    assert any(p.startswith("losses") for p in planted(lambda got: got["skipped"].__setitem__(1, True)))
    assert any(p.startswith("moments") for p in planted(
        lambda got: got["moments"].update({k: v * 2 for k, v in got["moments"].items() if k.endswith("exp_avg")})))
    assert any(p.startswith("weights") for p in planted(lambda got: got["weights"][first].add_(math.inf)))
    all_nan = planted(lambda got: [t.fill_(math.nan) for key in ("grads", "moments", "weights") for t in got[key].values()])
    assert {p.split()[0] for p in all_nan} >= {"grads", "moments", "weights"}


def test_the_reference_imports_nothing_from_diffpipe_but_the_model_adapters():
    """What the issue that built it asked: a reference sharing diffpipe's batch code hid a flipped target."""
    import ast

    from . import reference_loop

    tree = ast.parse(Path(reference_loop.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    ours = {name for name in imported if name.split(".")[0] == "diffpipe"}
    assert ours == {"diffpipe.models.family", "diffpipe.models.registry"}, ours
