"""The plain training loop the central test holds pipelined training against, written without diffpipe's code.

The one import from diffpipe is the model adapter under test (`ModelFamily`: the diffusers model class, its own
forward, its named conditions and latent layout, its LoRA targets). Everything else is built here from the
libraries' own parts: noisy inputs and targets from diffusers' `DDPMScheduler` (`add_noise`, `get_velocity`) and
the rectified-flow path as diffusers' Flux and SD3 training scripts write it; text through transformers' CLIP model
and tokenizer loaded from the run's text encoder folder; the digits from scikit-learn; LoRA by peft's
`inject_adapter_in_model`; torch's AdamW (or prodigyopt's Prodigy, transformers' Adafactor), `clip_grad_norm_`, `GradScaler` and a `LambdaLR` schedule.

Only random numbers come from the run (`Draws`): which items each step takes, their captions after caption
dropout, timesteps in (0, 1), noise, the LoRA A matrices' first values, and the clean images (and an edit model's
control latents) of datasets other than digits (made by diffpipe's data module, which tests/data checks). A wrong computation on any of them (a target's
sign, a text condition, a schedule step, LoRA's scale, AdamW's decay) shows as a difference.
"""
from __future__ import annotations

import re

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from peft import LoHaConfig, LoKrConfig, LoraConfig, inject_adapter_in_model
from safetensors.torch import load_file
from sklearn.datasets import load_digits
from transformers import AutoTokenizer, CLIPTextModelWithProjection

from diffpipe.models.family import TextBatch
from diffpipe.models.registry import family_for

__all__ = ["Draws", "StepDraw", "reference", "digits", "noised", "Text"]

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALE = 2.0 ** 16  # the trainer's LossScaler starts here and does not change in 3 clean steps


@dataclass
class StepDraw:
    indices: list[int]
    captions: list[str]
    t: torch.Tensor
    noise: torch.Tensor
    x0: torch.Tensor | None = None  # the items themselves, for data not read from scikit-learn here
    control: torch.Tensor | None = None  # an edit model's control latents of the items (synthetic data's)


@dataclass
class Draws:
    steps: list[StepDraw]
    initial_adapters: dict[str, torch.Tensor] = field(default_factory=dict)  # LoRA's A (and zero B) before step 0


DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def digits(held_out: bool = False) -> tuple[torch.Tensor, list[str]]:
    """scikit-learn's digits, pixels 0..16 scaled to [-1, 1] (N, 1, 8, 8), captioned "a handwritten digit seven":
    every fourth image is held out (the eval loss's), the others train."""
    data = load_digits()
    kept = [i for i in range(len(data.target)) if (i % 4 == 3) == held_out]
    images = torch.tensor(data.images[kept], dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    return images, [f"a handwritten digit {DIGIT_WORDS[d]}" for d in data.target[kept]]


def noised(objective: str, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor):
    """(noisy input, the backbone's timestep, target). Discrete objectives on Stable Diffusion's schedule (step =
    floor(1000 t)); flow matching on x_t = (1 - t) x0 + t noise with velocity noise - x0 and timestep 1000 t, as
    diffusers' train_dreambooth_lora_flux.py and _sd3.py compute them."""
    if objective == "flow_matching":
        s = t.view(-1, *[1] * (x0.dim() - 1))
        return (1 - s) * x0 + s * noise, t * 1000, noise - x0
    ddpm = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    step = (t * 1000).long().clamp(0, 999)
    noisy = ddpm.add_noise(x0, noise, step)
    target = noise if objective == "epsilon" else ddpm.get_velocity(x0, noise, step)
    return noisy, step.float(), target


class Text:
    """The run's CLIP text encoder: last hidden states and projected pooled output of captions padded to the
    run's length, with their attention mask."""

    def __init__(self, folder: str, max_length: int):
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model = CLIPTextModelWithProjection.from_pretrained(folder, local_files_only=True).eval()
        self.max_length = max_length

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokenizer(captions, padding="max_length", truncation=True, max_length=self.max_length,
                                return_tensors="pt")
        out = self.model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask)
        return out.last_hidden_state, out.text_embeds


def _lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Linear warm-up from 1/warmup of the peak at the first step to the peak at step `warmup` - 1, then constant
    or half a cosine to zero at `total` (diffusers' `get_scheduler` warms up from zero instead: a first step that
    does nothing)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1 + torch.cos(torch.tensor(torch.pi * progress)).item())


def _model(config, family, draws: Draws) -> torch.nn.Module:
    cls = family.model_class  # built from its config and loaded as saved (from_pretrained's fast path needs
    model = cls.from_config(cls.load_config(config.model.path)).train()  # accelerate for Wan's fp32-kept modules)
    model.load_state_dict(load_file(str(Path(config.model.path) / "diffusion_pytorch_model.safetensors")))
    for dropout in (m for m in model.modules() if isinstance(m, torch.nn.Dropout)):
        dropout.eval()  # train.dropout = false, as the pipeline
    # what the family never trains, frozen as the run freezes it: modules no prediction reads (where diffusers'
    # forward still runs them, HunyuanVideo 1.5's image embedder multiplied by zero, a plain loop's AdamW would decay
    # them with zero gradients)
    for name in family.unreached(model):
        model.get_submodule(name).requires_grad_(False)
    if config.adapter.type != "none":
        inject_adapter_in_model(_peft_config(config.adapter, family), model)
        adapters = {n: p for n, p in model.named_parameters() if _ADAPTER.search(n)}
        assert set(adapters) == set(draws.initial_adapters), "the run's adapters are not peft's on these targets"
        for name, p in model.named_parameters():
            p.requires_grad_(name in adapters)
        with torch.no_grad():
            for name, p in adapters.items():
                first = draws.initial_adapters[name]
                if _STARTS_AT_ZERO.search(name):  # the factor that makes the adapted model start as the base
                    assert not first.any(), f"{name} does not start at zero"
                if ".lora_magnitude_vector." in name:  # DoRA: peft's own, from the base weight at injection
                    torch.testing.assert_close(first, p, rtol=1e-6, atol=0)
                p.copy_(first)
    return model


_ADAPTER = re.compile(r"\.(lora_[AB]|lora_magnitude_vector|hada_w[12]_[ab]|lokr_w[12](_[ab])?)\.")
_STARTS_AT_ZERO = re.compile(r"\.(lora_B|hada_w2_b|lokr_w1)\.")


def _peft_config(adapter, family):
    """peft's config of adapter.type, as its documentation writes them (default initialisation)."""
    targets = adapter.target_modules or list(family.lora_targets)
    if adapter.type in ("lora", "dora"):
        return LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout,
                          target_modules=targets, use_dora=adapter.type == "dora")
    kind = LoHaConfig if adapter.type == "loha" else LoKrConfig
    return kind(r=adapter.rank, alpha=adapter.alpha, target_modules=targets)


def reference(config, draws: Draws, autocast: torch.dtype | None = None) -> dict:
    """The unsplit diffusers model in one process over the same micro-batches: every step's loss and gradient norm
    (before clipping), the first step's gradients (before clipping), and the weights and AdamW moments after the
    last step. `autocast` runs the forward under it (None: the config's precision). One thread, as each worker
    here: CPU kernels reduce in a thread-dependent order, which bf16 makes visible."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(config, draws, autocast)
    finally:
        torch.set_num_threads(threads)


def _train(config, draws: Draws, autocast: torch.dtype | None) -> dict:
    family = family_for(config.model.architecture)
    model = _model(config, family, draws)
    cfg = model.config
    text = Text(config.model.text_encoder, config.model.text_max_length)
    train = config.train
    objective = train.objective or family.default_objective
    dtype = autocast if autocast is not None else AUTOCAST.get(train.precision)
    scaler = torch.amp.GradScaler("cpu", init_scale=FP16_SCALE, enabled=dtype == torch.float16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(params, train)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: _lr_factor(s, train.warmup_steps, train.max_steps, train.lr_schedule))
    chunks = config.pipeline.microbatches * config.pipeline.data_parallel
    size = config.micro_batch_size
    out = {"losses": [], "grad_norms": [], "grads": None, "skipped": []}
    for step, drawn in enumerate(draws.steps):
        x0 = drawn.x0 if drawn.x0 is not None else digits()[0][drawn.indices]
        noisy, timestep, target = noised(objective, x0, drawn.noise, drawn.t)
        hidden, pooled = text(drawn.captions)
        height, width = x0.shape[-2:]
        size_ids = torch.tensor([[height, width, 0, 0, height, width]], dtype=torch.float32).expand(len(x0), 6)
        conditions = family.conditions(cfg, TextBatch(hidden, pooled, size_ids, tuple(x0.shape[2:]),
                                                      config.model.guidance, control=drawn.control))
        conditions["timestep"] = timestep
        if (clean := family.clean_latents(cfg, conditions, tuple(x0.shape[2:]))) is not None:
            target = target * (1 - clean[0])  # given clean (TI2V's first frame): predicted as zero
        noisy, target = family.pack(cfg, noisy), family.pack_prediction(cfg, target)
        opt.zero_grad(set_to_none=True)
        losses = []
        for i in range(chunks):
            part = slice(i * size, (i + 1) * size)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype in (torch.bfloat16, torch.float16)):
                prediction = family.diffusers_forward(model, noisy[part], {k: v[part] for k, v in conditions.items()})
            loss = F.mse_loss(prediction.float(), target[part].float())
            scaler.scale(loss).backward()
            losses.append(loss.detach())
        scaler.unscale_(opt)
        reached = [p for p in params if p.grad is not None]  # (Qwen-Image's last block: its text outputs are unused)
        for p in reached:
            p.grad /= chunks
        if step == 0:  # before clipping
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        norm = torch.nn.utils.get_total_norm([p.grad for p in reached])
        if train.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, train.max_grad_norm)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped = scaler.get_scale() < scale
        if not skipped:
            sched.step()
        out["skipped"].append(skipped)
        out["losses"].append(float(torch.stack(losses).mean()))
        out["grad_norms"].append(float(norm))
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out["weights"] = {n: p.detach() for n, p in trained}
    out["moments"] = {f"{n}:{k}": opt.state[p][k].view(p.shape) if k == "s" else opt.state[p][k]  # prodigyopt: s flat
                      for n, p in trained for k in OPTIMIZER_STATE[train.optimizer] if k in opt.state[p]}
    # Prodigy's steps are the learning rate times its estimate D (the largest it reached), AdamW's the learning rate
    out["step_size"] = train.learning_rate * opt.param_groups[0].get("d_max", 1.0)
    return out


# the optimizer's state compared after the last step (a checkpoint's keys, less the step count and Prodigy's p0)
OPTIMIZER_STATE = {"adamw": ("exp_avg", "exp_avg_sq"), "prodigy": ("exp_avg", "exp_avg_sq", "s"),
                   "adafactor": ("exp_avg", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col")}


def _optimizer(params, train) -> torch.optim.Optimizer:
    """torch's AdamW, prodigyopt's Prodigy (what diffpipe's own is written after) or transformers' Adafactor."""
    args = dict(train.optimizer_args)
    if train.optimizer == "prodigy":
        import prodigyopt

        return prodigyopt.Prodigy(params, lr=train.learning_rate, betas=tuple(train.betas), eps=train.adam_eps,
                                  weight_decay=train.weight_decay, **args)
    if train.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=train.learning_rate, weight_decay=train.weight_decay, relative_step=False,
                         warmup_init=False, scale_parameter=args.pop("scale_parameter", False), **args)
    return torch.optim.AdamW(params, lr=train.learning_rate, betas=tuple(train.betas), weight_decay=train.weight_decay,
                             eps=train.adam_eps)
