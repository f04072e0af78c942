"""The run configuration: TOML sections validated by pydantic, with a default and a line of help per field.

Every wrong key, type or value fails here, before any process starts, with a message that names the key
and what to change. Schema only: `validate_config` applies `--set section.key=value` overrides and validates;
reading a TOML file and what a model folder decides (its backbone's family, its objective) is config_files.py's.
"""
from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ConfigError

__all__ = [
    "ConfigError", "RunConfig", "ModelConfig", "DataConfig", "TrainConfig", "AdapterConfig", "PipelineConfig",
    "PlanConfig", "ObserveConfig", "CheckpointConfig", "OutputConfig", "SampleConfig", "MemoryConfig", "validate_config",
    "save_config", "make_paths_absolute",
]


class _Section(BaseModel):
    # inf and nan are refused everywhere: `train.learning_rate = inf` trained to NaN weights and ended "done"
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Section):
    architecture: str = Field("unet2d", description=(
        "Backbone family: a built-in name (docs/families.md says what each trains), or a ModelFamily subclass of "
        "your own as \"package.module:Class\"."))
    preset: str | None = Field("digits", description=(
        "Built-in backbone config of the family (unet2d: digits, sd15, sdxl; flux: digits, tiny, dev; sd3: digits, "
        "tiny, medium); ignored when `config` or `path` is set."))
    config: dict[str, Any] | None = Field(None, description=(
        "Backbone config as keyword arguments of the diffusers class (inline table)."))
    path: str | None = Field(None, description=(
        "Local diffusers pipeline folder (model_index.json, unet/ or transformer/, vae/, text encoders), backbone "
        "folder (config.json), or single .safetensors file of the backbone (diffusers' names, or the family's "
        "release layout: A1111/ComfyUI UNets, BFL's Flux, Stability's SD3, Wan's own) to load weights from."))
    components: str | None = Field(None, description=(
        "Local diffusers pipeline folder whose VAE, text encoders, tokenizers and scheduler the run uses when "
        "model.path is a single backbone file (e.g. the base model's folder, as ComfyUI users keep a fine-tune "
        "beside it); its backbone's config.json gives the architecture unless model.config is set. Unset: "
        "model.path's own, where it is a pipeline folder."))
    units: Literal["layers", "blocks"] = Field(
        "layers", description="Unit granularity the planner may cut at: layers (each resnet/transformer) or blocks.")
    text_encoder: str = Field("tiny-clip", description=(
        "Frozen text encoder: tiny-clip (built locally from a small config) or a local transformers CLIP folder."))
    text_max_length: int = Field(8, ge=2, le=16384, description=(
        "Tokens per caption (padded/truncated); a pipeline folder's tokenizers decide their own (77 for CLIP). Above "
        "512 only for plans and benchmarks of an edit model whose text holds a control's vision tokens "
        "(qwen_image_edit: 1536 at 1024x1024)."))
    guidance: float = Field(3.5, ge=0.0, description=(
        "Guidance-distilled models (Flux-dev: guidance_embeds = true): the guidance value embedded while training "
        "and sampling (diffusers' Flux scripts: 3.5)."))
    expert: Literal["high", "low", "both"] | None = Field(None, description=(
        "A pipeline folder with two experts (Wan 2.2 A14B: transformer/ for high noise, transformer_2/ for low "
        "noise, switched at model_index.json's boundary_ratio): the one this run trains, on its own timesteps only "
        "(high: t >= boundary_ratio; low: below; train.timestep_range overrides), or both: each sample trains the "
        "expert its timestep picks, as WanPipeline picks one (both experts' units i on one stage; "
        "models/two_experts.py). Required for such a folder; unset otherwise."))

    def pipeline_folder(self) -> Path | None:
        """The diffusers pipeline folder of the run's VAE, text encoders, tokenizers and scheduler: model.components,
        else model.path where it is one."""
        if self.components is not None:
            return Path(self.components)
        if self.path is not None and (Path(self.path) / "model_index.json").is_file():
            return Path(self.path)
        return None

    def describe(self) -> str:
        """The model in the user's words: where its architecture comes from (the preset only when it is used)."""
        if self.config is not None:
            source = "model.config" + (f", weights {self.path}" if self.path else "")
        elif self.path is not None:
            source = self.path if Path(self.path).is_dir() else f"preset {self.preset}, weights {self.path}"
        else:
            source = f"preset {self.preset}"
        return f"{self.architecture} ({source})"


class DataConfig(_Section):
    dataset: str = Field(  # a name of data/sources.py's SOURCES (checked by config_files)
        "digits", description=(
            "Where the training data comes from: digits (scikit-learn's handwritten digits, 8x8 pixels, captioned), "
            "moving_digits (clips of them sliding left, right, up or down, captioned with the motion; for video "
            "families), synthetic (random latents), or folder (your images with captions, through the VAE of "
            "model.path's pipeline folder)."))
    path: str | list[str] | None = Field(None, description=(
        "data.dataset = folder: folder(s) of jpg/png/webp/bmp/tiff/avif images, captions in same-named .txt (or "
        "kohya's .caption) files or a metadata.jsonl (file_name, text); subfolders included."))
    repeats: int | list[int] = Field(1, description=(
        "Times each folder's images appear per epoch (one number, or one per folder in data.path)."))
    resolution: int = Field(1024, ge=64, description=(
        "Images are trained at about resolution x resolution pixels of area (SD 1.5: 512, SDXL: 1024)."))
    buckets: bool = Field(True, description=(
        "Aspect-ratio buckets: sizes of that area and different shapes, each image going to the nearest; false: "
        "every image centre-cropped square."))
    bucket_step: int = Field(64, ge=8, description="Bucket sides are multiples of this many pixels.")
    max_aspect: float = Field(2.0, ge=1.0, description="Widest bucket shape (width over height, and its transpose).")
    bucket_sizes: list[list[int]] | None = Field(None, description=(
        "Buckets given as [width, height] pixel pairs instead of derived from resolution, bucket_step and "
        "max_aspect."))
    cache: bool = Field(True, description=(
        "Compute VAE latents and text-encoder outputs once and keep them on disk (safetensors shards keyed by "
        "fingerprints of images and models); false: the frozen VAE and text encoders run inside every step."))
    cache_dir: str | None = Field(None, description=(
        "Where the caches live; unset: a folder of diffpipe's cache home ($XDG_CACHE_HOME/diffpipe/data, else "
        "~/.cache/diffpipe/data) named for the first data folder, shared by runs on the same data (a .diffpipe_cache "
        "an earlier version wrote inside the data folder is still used). Machines that share no home folder: set it "
        "to a folder every machine sees."))
    eval_fraction: float = Field(0.0, ge=0.0, lt=0.5, description=(
        "data.dataset = folder: share of the image files held out of training for the eval loss (every k-th file in "
        "name order)."))
    regularisation_path: str | list[str] | None = Field(None, description=(
        "data.dataset = folder: folder(s) of regularisation (class, prior-preservation) images with captions, as "
        "DreamBooth and kohya's reg_data_dir use them: trained beside data.path's images in the same buckets and "
        "epochs, each sample's loss times data.regularisation_weight. Never held out for the eval loss."))
    regularisation_weight: float = Field(1.0, ge=0, description=(
        "The loss weight of each regularisation image's sample (kohya's prior_loss_weight); training images weigh 1."))
    mask_path: str | None = Field(None, description=(
        "data.dataset = folder: a folder of loss masks, one per picture under the same path relative to its "
        "data.path folder and the same name (any of jpg/png/webp/bmp/tiff/avif), the picture's size; white "
        "trains, black is left out, grey weighs in between (kohya's masked loss). Images only, not clips; the eval "
        "loss is unmasked."))
    control_path: str | None = Field(None, description=(
        "data.dataset = folder, an edit model (model.architecture = flux_kontext or qwen_image_edit): a folder of "
        "control images, one per picture under the same path relative to its data.path (or data.eval_path, "
        "data.regularisation_path) folder and the same name (any of jpg/png/webp/bmp/tiff/avif), as "
        "diffusion-pipe and musubi-tuner lay them out: what the picture is made from (an edit's source). Each is "
        "placed in its picture's bucket, encoded by the VAE and cached; the model reads it beside the noisy "
        "picture. Images only, not clips."))
    eval_path: str | list[str] | None = Field(None, description=(
        "data.dataset = folder: folder(s) of images with captions for the eval loss instead of data.eval_fraction."))
    frame_buckets: list[int] = Field([1, 33], min_length=1, description=(
        "Video families on folders: clip lengths in video frames. Each video trains as its first F frames, F the "
        "longest bucket it fills (shorter videos are skipped and counted); still images as clips of 1 frame when 1 "
        "is listed. Wan's VAE needs 1 + 4k frames (1, 33, 81)."))
    frames: int | None = Field(None, ge=1, description=(
        "Video families on moving_digits or synthetic clips: latent frames per clip; unset: the family's default "
        "(digits clips 4; Wan 21, i.e. 81 video frames through its VAE)."))
    latent_size: list[Annotated[int, Field(ge=1)]] | None = Field(None, min_length=2, max_length=2, description=(
        "digits, moving_digits and synthetic data, and plans: [height, width] of the latents trained on (for a "
        "real-width model, pixels / 8: [60, 104] is 480x832); unset: the family's default (a 1024 square for image "
        "models, 480x480 for Wan). Folders: set by data.resolution and the buckets."))
    caption_dropout: float = Field(0.1, ge=0.0, le=1.0, description=(
        "Fraction of captions replaced by the empty caption (enables guidance)."))
    caption_shuffle: bool = Field(False, description=(
        "Shuffle each training caption's comma-separated tags every step, the first data.keep_tokens staying in "
        "place (kohya's shuffle_caption): the model stops learning the tags' order. The text encoders then stay on "
        "the device and encode each shuffled caption as it comes (the cache holds the captions as written). Eval and "
        "samples use the captions as written."))
    keep_tokens: int = Field(0, ge=0, description=(
        "With data.caption_shuffle or data.tag_dropout: this many leading tags stay in place and are never dropped "
        "(a trigger word, the subject)."))
    tag_dropout: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "Drop each comma-separated tag of a training caption after the first data.keep_tokens with this probability, "
        "every step (kohya's caption_tag_dropout_rate); the text encoders then encode such captions as they come, as "
        "with data.caption_shuffle."))
    text_cache_gib: float = Field(1.0, ge=0, description=(
        "digits and synthetic: encode each distinct caption once and keep the text encoder's outputs on its device "
        "when they all fit in this many GiB; 0: encode every step's captions."))

class TrainConfig(_Section):
    max_steps: int = Field(100, ge=1, description="Optimizer steps to run (unless train.epochs is set).")
    epochs: int = Field(0, ge=0, description=(
        "Passes over the training data, instead of train.max_steps: the run takes this many epochs' steps, counted "
        "once the data is read and printed at the start (an image folder's epoch is, over its aspect-ratio buckets, "
        "each bucket's items / batch_size rounded up: a bucket's last batch is filled from its start; digits and "
        "synthetic data: items / batch_size, the run's total rounded up). The epoch is in metrics.jsonl and the "
        "progress bar. 0: train.max_steps decides."))
    batch_size: int = Field(32, ge=1, description=(
        "Global batch: micro-batch size x pipeline.microbatches x pipeline.data_parallel."))
    optimizer: Literal["adamw", "adafactor", "prodigy"] = Field("adamw", description=(
        "adamw (torch's fused AdamW; memory.optimizer_state may hold its moments in 8 bits); adafactor "
        "(transformers' Adafactor with the learning rate and schedule given here, as kohya's `relative_step=False "
        "scale_parameter=False warmup_init=False`: a matrix's second moment kept as a row and a column mean, no "
        "first moment; learning rates about 1e-5 to 4e-7 for full fine-tunes); prodigy (Prodigy, step size estimated "
        "by the run over every weight of every stage: set train.learning_rate = 1.0, its multiplier, as its users "
        "do). adafactor and prodigy: not with pipeline.data_parallel_shard; prodigy: not with train.stage_lr_scale."))
    optimizer_args: dict[str, float | bool | None] = Field({}, description=(
        "Settings of adafactor or prodigy beyond the ones above, by their own names: adafactor's clip_threshold "
        "(1.0), decay_rate (-0.8), beta1 (unset: no first moment), scale_parameter (false); prodigy's d_coef (1.0), "
        "d0 (1e-6), growth_rate (unlimited), beta3 (the square root of betas[1]), use_bias_correction (false), "
        "safeguard_warmup (false; true with warm-up, as its authors suggest). AdamW takes none (its are betas, "
        "adam_eps, weight_decay)."))
    learning_rate: float = Field(1e-3, gt=0, description=(
        "Peak learning rate (Prodigy: the multiplier of the step size it estimates, 1.0 as a rule)."))
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (AdamW, Adafactor, Prodigy).")
    betas: list[Annotated[float, Field(ge=0, lt=1)]] = Field([0.9, 0.999], min_length=2, max_length=2, description=(
        "AdamW's and Prodigy's betas, each in [0, 1)."))
    adam_eps: float = Field(1e-8, gt=0, description=(
        "AdamW's and Prodigy's epsilon (added to the root of the second moment)."))
    lr_schedule: Literal["constant", "cosine"] = Field("cosine", description="Learning-rate schedule after warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    max_grad_norm: float = Field(1.0, ge=0, description=(
        "Clip gradients to this global norm over all stages; 0 turns clipping off."))
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description=(
        "fp32, bf16 autocast, or fp16 autocast with a loss scaler."))
    fp8_compute: bool | Literal["auto"] = Field(False, description=(
        "Matrix products on fp8 tensor cores, under bf16 precision. LoRA-type runs: the frozen base's linear "
        "layers (stored in fp8: memory.base_dtype \"fp8\" or auto) run their forward and input-gradient products "
        "in fp8 (torch._scaled_mm, each activation and gradient quantised per token as it enters; layers whose "
        "sides are not multiples of 16 compute as fp8 storage does). Full fine-tunes (adapter.type \"none\"): the "
        "trained linear layers (on a GPU, those wide enough for fp8 to pay: torchao's thresholds) run all three "
        "products in fp8 through torchao's float8 training (rowwise scales; fp32 weights kept; "
        "models/fp8_training.py). Needs a GPU with fp8 (Ada, Hopper, Blackwell) or torch 2.13's "
        "CPU kernel. Faster only where the quantisation is fused: with pipeline.compile = \"blocks\" "
        "(docs/benchmarks.md); changes the arithmetic (each operand within 2^-4). \"auto\": on where the planner "
        "counts it faster at no more memory (a LoRA-type run with compiled blocks or a stage compiled whole, on a "
        "GPU with fp8 tensor cores, replicas not sharded); off elsewhere (full fine-tunes included), never "
        "refused."))
    fp8_attention: bool = Field(False, description=(
        "Self-attention's two products and their gradients on fp8 tensor cores, under bf16 precision: Wan's "
        "(other families are refused for now; cross-attention to the text stays bf16) runs cuDNN's fp8 "
        "flash-attention kernels through NVIDIA's cudnn-frontend (pip install 'diffpipe[fp8-attention]'; a Hopper or "
        "Blackwell GPU), q, k, v and the output's gradient each scaled by its own maximum, the backward's products "
        "by the last backward's (models/fp8_attention.py). Changes the arithmetic more than fp8_compute: "
        "attention's output and gradients land 5-15 % (relative) from fp32's on random operands, bf16's 0.3-0.5 %. "
        "On a CPU the same arithmetic written out (for tests). Not yet timed on a GPU; the planner does not count "
        "it."))
    objective: Literal["epsilon", "v_prediction", "flow_matching"] | None = Field(
        None, description=(
            "What the model predicts; unset: the prediction_type of model.path's pipeline scheduler (epsilon or "
            "v_prediction), else flow_matching."))
    timestep_sampling: Literal["uniform", "logit_normal", "shift", "importance"] = Field(
        "logit_normal", description="Training timestep density (importance: p(t) proportional to 0.99^t).")
    logit_mean: float = Field(0.0, description="Mean of the logit-normal density.")
    logit_std: float = Field(1.0, gt=0, description="Standard deviation of the logit-normal density.")
    shift: Annotated[float, Field(gt=0)] | Literal["resolution"] = Field(3.0, description=(
        "Shift factor for timestep_sampling = shift (SD3's t' = s t / (1 + (s - 1) t)). \"resolution\": each step's "
        "s = e^mu from its latent tokens, as FluxPipeline and QwenImagePipeline shift by resolution (mu linear in "
        "the tokens between the pipeline scheduler's base_image_seq_len / base_shift and max_image_seq_len / "
        "max_shift; Flux.1's 256 / 0.5 and 4096 / 1.15 where model.path's scheduler does not shift dynamically; "
        "musubi-tuner's flux_shift / qwen_shift); eval quantiles at each held-out batch's own."))
    timestep_range: Annotated[list[Annotated[float, Field(ge=0.0, le=1.0)]], Field(min_length=2, max_length=2)] | None = Field(None, description=(
        "[low, high]: train only on timesteps t (1 = pure noise) in this range, drawn from train.timestep_sampling's "
        "density cut to it (musubi-tuner's min/max_timestep); the eval quantiles are the cut density's. Unset: the "
        "whole range, or the expert's (model.expert)."))
    ema_decay: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "Keep an exponential moving average of the trained weights, as diffusers' EMAModel does (after step n it "
        "moves 1 - min(decay, (1 + n - 1) / (10 + n - 1)) of the way toward the weights; 0.999-0.9999 for full "
        "fine-tunes). It is checkpointed and resumed, and the run's outputs are the averaged model: samples during "
        "and after training, model.safetensors / lora.safetensors, exports (every N steps, or of a checkpoint); the "
        "eval loss is the trained weights'. Costs a copy of the trained weights in device memory. 0: off."))
    min_snr_gamma: float = Field(0.0, ge=0, description=(
        "Min-SNR-gamma loss weighting (Hang et al., arXiv:2303.09556; kohya's and diffusers' min_snr_gamma): each "
        "sample's loss times min(SNR(t), gamma) / SNR(t) for epsilon prediction, / (SNR(t) + 1) for v-prediction, so "
        "the easy low-noise timesteps stop dominating (5 is the paper's value). epsilon and v_prediction objectives "
        "only; the eval loss stays unweighted. 0: off."))
    noise_offset: float = Field(0.0, ge=0, description=(
        "Add this times one Gaussian number per sample and channel (the same over every pixel and frame) to the "
        "training noise, as diffusers' and kohya's trainers do (0.05-0.1 for SD 1.5 and SDXL: the model learns to "
        "change an image's overall brightness); eval batches keep plain noise. 0: off."))
    multires_noise_iterations: int = Field(0, ge=0, le=20, description=(
        "Multi-resolution (pyramid) training noise, kohya's multires_noise_iterations (6-10 suggested): this many "
        "layers of Gaussian noise (layer i drawn at the latent's height and width / r^i, r in [2, 4), enlarged back) "
        "added to the noise (after train.noise_offset), each sample scaled back to standard deviation 1; eval "
        "batches keep plain noise. 0: off."))
    multires_noise_discount: float = Field(0.3, gt=0, le=1, description=(
        "With train.multires_noise_iterations: level i's layer is weighted discount^i (kohya's "
        "multires_noise_discount; 0.1 is often suggested)."))
    seed: int = Field(0, ge=0, description="Seed for weights, data order, timesteps and noise.")
    dropout: bool = Field(True, description=(
        "Keep the model's own dropout layers in training (the spatio-temporal UNet's temporal convolutions drop 10 "
        "%); false: off, so a step is a deterministic function of the batch."))
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "auto: CUDA with NCCL when available, else CPU with gloo."))
    log_every: int = Field(1, ge=1, description="Write metrics every N steps.")
    collective_timeout_minutes: float = Field(30.0, gt=0, le=7 * 24 * 60, description=(
        "How long a process waits in a send, receive or collective for the others before it fails with an error "
        "instead of hanging (another process died or hangs on another machine). It must exceed the longest wait of a "
        "healthy run: the slowest process's share of a cache build, a checkpoint's save."))
    max_bad_steps: int = Field(10, ge=1, description=(
        "Stop the run after this many steps in a row skipped for a non-finite loss or gradients (fp16 overflows "
        "included)."))
    eval_every: int = Field(0, ge=0, description=(
        "Eval loss every N steps and at the end (eval_loss and eval_loss_tQ per quantile in metrics.jsonl and "
        "TensorBoard) on the held-out data: data.eval_fraction / data.eval_path for folders, the held-out digits for "
        "digits; 0: never."))
    eval_quantiles: list[float] = Field([0.1, 0.3, 0.5, 0.7, 0.9], min_length=1, description=(
        "Quantiles of the training timestep density the eval loss is measured at (the same timesteps and noise every "
        "time)."))
    stage_lr_scale: list[Annotated[float, Field(ge=0)]] | None = Field(None, description=(
        "Per-stage learning-rate multipliers (one per stage, 0 or more); unset: all 1."))

    @model_validator(mode="after")
    def _check_timestep_range(self) -> "TrainConfig":
        if self.timestep_range is not None and not self.timestep_range[0] < self.timestep_range[1]:
            raise ValueError(f"train.timestep_range={self.timestep_range} is empty: give [low, high] with low < high "
                             "(t = 1 is pure noise)")
        if self.shift == "resolution" and self.timestep_sampling != "shift":
            raise ValueError(f"train.shift = \"resolution\" shifts the \"shift\" density, and train.timestep_sampling "
                             f"is {self.timestep_sampling!r}: set train.timestep_sampling = \"shift\"")
        return self


class AdapterConfig(_Section):
    type: Literal["none", "lora", "dora", "loha", "lokr"] = Field("none", description=(
        "none: full fine-tune; else adapters trained on the frozen backbone through peft: lora (W + B A), dora (LoRA "
        "whose output rows are rescaled to a trained magnitude: DoRA), loha (W + (W1a W1b) * (W2a W2b), LyCORIS' "
        "LoHa), lokr (W + kron(W1, W2), LyCORIS' LoKr). Every type trains on every layout, checkpoints, resumes and "
        "merges into model.safetensors; exports: lora in every format, dora in diffusers and comfyui, loha and lokr "
        "in comfyui (LyCORIS' keys, which ComfyUI, Forge and A1111 read)."))
    rank: int = Field(16, ge=1, description="Adapter rank (r).")
    alpha: float = Field(16.0, gt=0, description=(
        "Adapter alpha: the update is scaled by alpha / rank (as peft and LyCORIS do, for every adapter.type)."))
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA branch's input (lora, dora).")
    target_modules: list[str] | None = Field(None, description=(
        "Module names (suffixes) that get adapters; unset: the attention projections to_q, to_k, to_v, to_out.0."))
    init_from: str | None = Field(None, description=(
        "Start the adapters from a LoRA file (a run's lora.safetensors, or diffusers' "
        "pytorch_lora_weights.safetensors) instead of peft's initialisation."))

    @model_validator(mode="after")
    def _dropout_where_it_exists(self):
        if self.dropout and self.type in ("loha", "lokr"):
            raise ValueError(f"adapter.dropout is the dropout on a LoRA branch's input, which {self.type} has not: "
                             "set adapter.dropout = 0 (or adapter.type = \"lora\" / \"dora\")")
        return self


class PipelineConfig(_Section):
    stages: int = Field(2, ge=1, description="Pipeline-parallel degree: processes per model replica.")
    virtual_stages: int = Field(1, ge=1, description=(
        "Stages per process (interleaved_1f1b and zb1p need 2 or more; zbv and dualpipev exactly 2)."))
    data_parallel: int = Field(1, ge=1, description=(
        "Data-parallel replicas of the pipeline; processes = stages x data_parallel."))
    sequence_parallel: int = Field(1, ge=1, description=(
        "Processes that split every sample's tokens between them inside each stage (Ulysses: attention exchanges "
        "token shards for head shards and back); processes = stages x data_parallel x sequence_parallel. For long "
        "clips whose activations no stage fits: docs/multi-gpu.md. Families with a DiT whose attention diffusers can "
        "split (Wan text- and image-to-video, Flux.1, Qwen-Image, HunyuanVideo 1.5); heads it does not divide are "
        "padded (not with pipeline.compile); each sample's tokens must divide by it except for Wan and Flux, "
        "which pad the last shares and mask the pad."))
    data_parallel_shard: bool = Field(False, description=(
        "With data_parallel > 1: cut each stage's fp32 weights, gradients and AdamW state across its replicas "
        "(torch's FSDP2 fully_shard). With pipeline.stages = 1 each unit's weights are gathered only while it "
        "computes and every micro-batch's gradients reduced into each replica's part (16/data_parallel bytes per "
        "trained parameter, plus two units whole: a model too large for one GPU trains without a pipeline); in a "
        "pipeline, whole weights and summed gradients are held through each step (8 + 16/data_parallel bytes). "
        "False: every replica holds everything (torch's replicate: gradients all-reduced)."))
    schedule: str = Field(  # a name of pipeline/schedules.py's SCHEDULES (checked by config_files)
        "1f1b", description=(
            "Pipeline schedule (torch.distributed.pipelining): gpipe, 1f1b, interleaved_1f1b "
            "(pipeline.virtual_stages >= 2 per process), or the zero-bubble ones, which split each backward into "
            "input and weight gradients: zb1p (interleaved, virtual_stages >= 2), zbv and dualpipev (V-shaped: "
            "virtual_stages = 2)."))
    microbatches: int = Field(4, ge=1, description="Micro-batches per step and replica.")
    split: list[int] | Literal["auto", "parameters"] = Field(
        "auto", description=(
            "Unit indices where stages 2.. begin; auto (the cost-model planner) or parameters (balanced by parameter "
            "count)."))
    checkpointing: list[int] | Literal["none", "all", "auto"] = Field(
        "none", description=(
            "Activation checkpointing: none, all, auto (only stages that would not fit, and of those only the fewest "
            "of their last units with which they fit), or stage indices (those stages whole)."))
    recomputed_units: list[int] | None = Field(
        None, description=(
            "How many units of each stage run checkpointed, counted from the stage's end, one number per stage "
            "(0: none; a stage's unit count or more: all of it). Chosen by the planner under checkpointing = "
            "\"auto\" and written to the run's config.toml; given here, it replaces pipeline.checkpointing."))
    compile: bool | Literal["blocks"] = Field(
        False, description=(
            "torch.compile: true compiles each stage whole (one graph per stage and input shape); \"blocks\" "
            "compiles only the model's repeated blocks (diffusers' _repeated_blocks, e.g. each transformer block), "
            "which compiles about 10x faster; the first steps of each shape are slow while it compiles. For a UNet "
            "true runs faster: an SDXL full fine-tune at torch.compile(unet)'s speed, where \"blocks\" (its "
            "transformer blocks only) gave 0.96x that at batch 8 on an H200 and 0.66x at batch 3 in fp8 on an H100."))


class PlanConfig(_Section):
    device_tflops: float | None = Field(None, gt=0, description=(
        "Sustained TFLOP/s per device for units not profiled; unset: 300 on CUDA (H200 eager bf16), 0.05 on CPU."))
    link_gbps: float | None = Field(None, gt=0, description=(
        "GB/s between neighbouring stages; unset: 100 on CUDA (NVLink), 2 on CPU (gloo, one host)."))
    memory_gib: float | None = Field(None, gt=0, description=(
        "Memory per device in GiB; unset: the GPU's own, unlimited on CPU."))
    memory_headroom: float = Field(0.1, ge=0, lt=1, description=(
        "Share of each device's memory the plan leaves free for what it does not count (the CUDA context, NCCL's "
        "buffers, the allocator's fragmentation) and for its own estimate's error (measured peaks on H200s mostly "
        "within 10 % of the plan; dualpipev up to 21 % over)."))
    profile: str | None = Field(None, description=(
        "JSON of measured unit times from `diffpipe plan --profile`, reused when present."))
    host_gbps: float = Field(25.0, gt=0, description=(
        "GB/s from pinned host memory to a device (memory.block_swap's copies): about 25 over PCIe 4.0 x16, 50 over "
        "PCIe 5.0."))


class ObserveConfig(_Section):
    enabled: bool = Field(True, description="Time the stages (a barrier and one small gather per timed step).")
    every: int = Field(1, ge=1, description=(
        "Time one step in N (and observe.timeline_step); 10 or more on GPUs keeps the cost unmeasurable."))
    log_every: int = Field(50, ge=0, description=(
        "Print one line per stage (compute, comm, bubble, peak) every N steps; 0: never."))
    timeline_step: int = Field(3, ge=0, description=(
        "Step drawn into timeline.png (and timeline.json) in the run folder."))
    anomaly_factor: float = Field(2.5, gt=1, description=(
        "Warn when a stage's latency exceeds this multiple of its rolling mean."))
    anomaly_warmup: int = Field(5, ge=1, description="Steps of history before the monitor judges.")
    on_anomaly: Literal["warn", "checkpoint", "stop"] = Field(
        "warn", description=(
            "After a warning: warn only, checkpoint (write a checkpoint now), or stop (save weights and exit)."))
    tensorboard: bool = Field(True, description="Write TensorBoard scalars into RUN_DIR/tensorboard.")
    wandb: bool = Field(False, description="Also log to Weights & Biases (needs `pip install wandb` and a login).")


class CheckpointConfig(_Section):
    every: int = Field(500, ge=0, description=(
        "Write a checkpoint (weights, AdamW state, progress) every N steps, and at the end when output.save_weights "
        "and checkpoints are on; 0: not by steps. Resume with `diffpipe train CONFIG --resume RUN_DIR`."))
    every_minutes: float = Field(0.0, ge=0, description=(
        "Also write one when this many minutes have passed since the last (the main process's clock decides for "
        "all); 0: off."))
    keep: int = Field(2, ge=1, description="Newest checkpoints kept in RUN_DIR/checkpoints; older ones are removed.")
    asynchronous: bool = Field(False, description=(
        "Copy the checkpoint to host memory and write it in the background while training goes on (sealed before the "
        "next one and at the end); needs host memory for one checkpoint."))
    export_every: int = Field(0, ge=0, description=(
        "LoRA runs: every N steps, and after the last, also write the adapters as "
        "RUN_DIR/exports/lora-step-0000N.safetensors in checkpoint.export_format, ready to load (kohya's per-epoch "
        "saves); 0: off. Any run's checkpoint exports later with `diffpipe export RUN --step N`."))
    export_every_epochs: int = Field(0, ge=0, description=(
        "LoRA runs: also export the adapters (as checkpoint.export_every does) after every N epochs of the data "
        "(train.epochs' epochs: kohya's save_every_n_epochs), named by the step they end at, and after the last "
        "step; 0: off."))
    export_format: Literal["diffusers", "kohya", "comfyui"] = Field("diffusers", description=(
        "Layout of checkpoint.export_every's files: diffusers (pipe.load_lora_weights; every family with a diffusers "
        "LoRA loader), kohya (ComfyUI, A1111, kohya's tools; UNets) or comfyui (ComfyUI's LoRA loader: UNets, Flux, "
        "SD3, Wan, Z-Image, Qwen-Image, FLUX.2, LTX-2)."))


class OutputConfig(_Section):
    dir: str = Field("runs/run", description="Run folder: config, weights, metrics, pictures.")
    sample_every_end: bool = Field(True, description="Write samples.png at the end of training.")
    save_weights: bool = Field(True, description=(
        "Write model.safetensors at the end (off for benchmarks of large models)."))


class MemoryConfig(_Section):
    base_dtype: Literal["auto", "fp32", "bf16", "fp8", "int8", "nf4"] = Field("auto", description=(
        "How frozen weights (a LoRA run's base) are stored: fp32; bf16 (half the memory; computed under "
        "train.precision's autocast as before, which rounds weights to bf16/fp16 per op anyway); fp8 (the linear "
        "layers' weights in fp8 e4m3 with a scale per output row, turned back into the compute dtype as each layer "
        "runs; the rest of the base in bf16, or fp32 under fp32 precision: a quarter of fp32 for Flux or Wan, and a "
        "slightly different model: each weight within 2^-4 of its value); int8 (the linear layers' weights in int8 "
        "with a scale per output row, through bitsandbytes: as small as fp8, each weight within 1/254 of its row's "
        "largest); nf4 (4-bit NormalFloat, QLoRA's format, through bitsandbytes: about an eighth of fp32, each "
        "weight within 0.152 of its block of 64's largest: a visibly different model). auto: bf16 for LoRA runs on "
        "CUDA with bf16/fp16 precision, else fp32. A full fine-tune (adapter.type none) has no frozen base: only "
        "auto or fp32 there. fp8, int8 and nf4 not with sharded replicas (pipeline.data_parallel_shard)."))
    optimizer_state: Literal["fp32", "8bit", "auto"] = Field("fp32", description=(
        "How AdamW's two moments are held: fp32 (8 bytes a trained parameter), or 8bit (bitsandbytes' AdamW8bit: "
        "each moment in 8 bits with a scale per block of 256, about 2 bytes a parameter; parameters under 4096 "
        "elements keep fp32 moments). Not with pipeline.data_parallel_shard (its kernels need whole tensors). auto: "
        "fp32, or 8bit where the planned layout fits neither with fp32 moments nor, where block_swap is auto too, "
        "with swapped units (planner/levers.py gives the order); printed and written to the run's config.toml."))
    block_swap: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(0, description=(
        "Frozen weights of this many units of each stage (the last ones holding frozen weights: a LoRA base's "
        "blocks) kept in pinned host memory and copied to the GPU for each use, ahead of it on a side stream; those "
        "units run checkpointed (their forward again before their backward). A stage then holds two such units' "
        "frozen weights instead of all. auto: the fewest that make the planned layout fit plan.memory_gib (0 where "
        "it fits without; chosen before launch and written to the run's config.toml). Not with data_parallel > 1 or "
        "pipeline.compile = true (auto is 0 there; \"blocks\" compiles each block on the copies it is given), nor "
        "on a full fine-tune; a count above the units of every stage that "
        "hold frozen weights is refused."))
    quantise_if_needed: list[Literal["int8", "fp8", "nf4"]] = Field([], description=(
        "With base_dtype = auto: the formats of frozen linear weights (see base_dtype) the planner may choose, tried "
        "in this order, where the planned layout fits neither as configured nor with 8-bit moments where "
        "optimizer_state is auto; each changes the model (docs/benchmarks.md measures how much). Empty: never. The "
        "choice is printed and written to the run's config.toml."))


class SampleConfig(_Section):
    steps: int = Field(30, ge=1, description="Sampler steps (Euler for flow matching, DDIM otherwise).")
    guidance_scale: float = Field(3.0, ge=0, description="Classifier-free guidance scale; 1 turns guidance off.")
    guidance_interval: list[float] = Field([0.0, 1.0], min_length=2, max_length=2, description=(
        "[low, high]: guidance only at noise levels t in this range (0 clean, 1 pure noise: the model's timestep / "
        "1000), the prompt alone elsewhere. Guidance at the noisiest steps narrows the samples' variety without "
        "making them more recognisable (Kynkaanniemi et al. 2024, arXiv:2404.07724); [0, 1]: at every step."))
    seeds: list[int] = Field([0, 1, 2, 3], min_length=1, description="Seeds of the rows of samples.png.")
    every: int = Field(0, ge=0, description=(
        "Also sample during training every N steps, through the pipeline itself (no weights gathered): "
        "RUN_DIR/samples/step-N.png and TensorBoard; 0: only samples.png at the end."))
    prompts: list[str] = Field([], description=(
        "Prompts (columns) of samples.png for image folders; unset: up to 4 distinct captions of the data (an edit "
        "model with data.control_path: the first 4 pictures' captions, each with its control image)."))
    control_images: list[str] = Field([], description=(
        "An edit model (flux_kontext, qwen_image_edit): the image each of sample.prompts edits, one per prompt, "
        "placed at the sample size and encoded by the VAE; unset: with data.control_path, the first pictures' own "
        "controls."))

    @model_validator(mode="after")
    def _check_interval(self) -> "SampleConfig":
        low, high = self.guidance_interval
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"sample.guidance_interval = {list(self.guidance_interval)}: give [low, high] with "
                             "0 <= low <= high <= 1 (noise levels: 0 clean, 1 pure noise)")
        if self.control_images and len(self.control_images) != len(self.prompts):
            raise ValueError(f"sample.control_images lists {len(self.control_images)} image(s) for "
                             f"{len(self.prompts)} sample.prompts; give one control image per prompt")
        return self


class RunConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="The backbone.")
    data: DataConfig = Field(default_factory=DataConfig, description="The training data.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation and diffusion.")
    adapter: AdapterConfig = Field(default_factory=AdapterConfig, description=(
        "Full fine-tune or adapters (LoRA, DoRA, LoHa, LoKr)."))
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Stages, schedule, data parallelism.")
    plan: PlanConfig = Field(default_factory=PlanConfig, description="Hardware figures for the stage planner.")
    observe: ObserveConfig = Field(default_factory=ObserveConfig, description=(
        "Per-stage timing, timeline, monitor, TensorBoard."))
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description=(
        "Checkpoints to resume from, on any layout."))
    output: OutputConfig = Field(default_factory=OutputConfig, description="Where results go.")
    sample: SampleConfig = Field(default_factory=SampleConfig, description="Sampling during and after training.")
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description=(
        "How weights are held: the levers that fit a model on a smaller GPU."))

    @model_validator(mode="after")
    def _check_batch_arithmetic(self) -> "RunConfig":
        p, t = self.pipeline, self.train
        per_micro = p.microbatches * p.data_parallel
        if t.batch_size % per_micro:
            low = (t.batch_size // per_micro) * per_micro
            nearest = [v for v in (low, low + per_micro) if v > 0]
            raise ValueError(
                f"train.batch_size={t.batch_size} is not divisible by pipeline.microbatches ({p.microbatches}) x "
                f"pipeline.data_parallel ({p.data_parallel}) = {per_micro}; nearest valid batch sizes: "
                f"{' or '.join(map(str, nearest))}")
        if isinstance(p.split, list):
            if len(p.split) != p.stages * p.virtual_stages - 1:
                raise ValueError(
                    f"pipeline.split lists {len(p.split)} boundaries but pipeline.stages x pipeline.virtual_stages = "
                    f"{p.stages * p.virtual_stages} stages need {p.stages * p.virtual_stages - 1}; or set split = \"auto\"")
            if any(b <= a for a, b in zip([0] + p.split, p.split)):
                raise ValueError(f"pipeline.split={p.split} must be strictly increasing unit indices above 0")
        if any(not 0 < q < 1 for q in t.eval_quantiles):
            raise ValueError(f"train.eval_quantiles={t.eval_quantiles}: each must lie strictly between 0 and 1")
        chunks = p.stages * p.virtual_stages
        if self.train.stage_lr_scale is not None and len(self.train.stage_lr_scale) != chunks:
            raise ValueError(f"train.stage_lr_scale lists {len(self.train.stage_lr_scale)} multipliers for {chunks} "
                             "stages; give one per stage or leave it unset")
        if self.memory.base_dtype == "bf16" and t.precision == "fp32":
            raise ValueError("memory.base_dtype = \"bf16\" stores frozen weights in bf16, which fp32 compute cannot "
                             "use: set train.precision = \"bf16\" (or \"fp16\"), or memory.base_dtype = \"fp32\"")
        if self.adapter.type == "none" and (self.memory.base_dtype not in ("auto", "fp32")
                                            or self.memory.block_swap not in (0, "auto")):
            # a full fine-tune trains every weight: no frozen base to store otherwise or to keep in host memory
            key = "base_dtype" if self.memory.base_dtype not in ("auto", "fp32") else "block_swap"
            raise ValueError(f"memory.{key} = {getattr(self.memory, key)!r} changes how a LoRA run's frozen base is "
                             "held, and adapter.type = \"none\" (a full fine-tune) trains every weight, so it would "
                             f"change nothing: leave memory.{key} out, or train adapters (adapter.type = \"lora\")")
        if self.memory.block_swap not in (0, "auto") and (p.data_parallel > 1 or p.compile is True):
            raise ValueError("memory.block_swap moves weights between host and device while a step runs, which "
                             "data-parallel replicas (they synchronise every weight) and a stage compiled whole "
                             "(pipeline.compile = true: one graph over units whose weights come and go) do not "
                             "allow: set pipeline.data_parallel = 1 and pipeline.compile = \"blocks\" or false, or "
                             "memory.block_swap = 0")
        held = self.quantised_base
        if held and p.data_parallel_shard and p.data_parallel > 1:  # layouts searched: `whole_tensors`
            raise ValueError(f"pipeline.data_parallel_shard cuts every weight across the replicas, and a base held in "
                             f"{held} keeps a scale per row beside each linear weight that is not cut alike: such "
                             "a run trains and then fails writing its weights. Set pipeline.data_parallel_shard = "
                             "false (each replica holds the whole "
                             f"{held} base), or memory.base_dtype = \"bf16\"")
        if self.memory.optimizer_state == "8bit" and p.data_parallel_shard and p.data_parallel > 1:
            raise ValueError("memory.optimizer_state = \"8bit\" updates whole tensors (bitsandbytes' kernels), which "
                             "pipeline.data_parallel_shard cuts across replicas: set one of them off")
        _check_optimizer(t, self.memory, p)
        if (self.checkpoint.export_every or self.checkpoint.export_every_epochs) and self.adapter.type == "none":
            raise ValueError("checkpoint.export_every writes a LoRA's adapters (as export_every_epochs does), and adapter.type is \"none\": set "
                             "checkpoint.every and export a checkpoint with `diffpipe export RUN --step N`, or train "
                             "adapters (adapter.type = \"lora\", \"dora\", \"loha\" or \"lokr\")")
        if t.fp8_compute is True and (problem := fp8_compute_problem(self)):
            raise ValueError(problem)
        if t.fp8_attention and t.precision != "bf16":
            raise ValueError(f"train.fp8_attention runs attention on fp8 tensor cores under bf16 precision, and "
                             f"train.precision = \"{t.precision}\": set train.precision = \"bf16\", or "
                             "train.fp8_attention = false")
        if t.fp8_attention and p.sequence_parallel > 1:
            raise ValueError("train.fp8_attention is not yet tested with the all-to-alls of pipeline.sequence_parallel: "
                             "set pipeline.sequence_parallel = 1, or train.fp8_attention = false")
        if self.adapter.type == "dora" and self.memory.base_dtype in ("fp8", "int8", "nf4"):
            raise ValueError(f"adapter.type = \"dora\" rescales each row of the whole base weight by its norm in every "
                             f"step (peft reads the weight itself), and memory.base_dtype = \"{self.memory.base_dtype}\" "
                             "stores it in a form only its own product reads: set memory.base_dtype = \"bf16\", or "
                             "train lora, loha or lokr")
        if isinstance(p.checkpointing, list) and any(not 0 <= i < chunks for i in p.checkpointing):
            raise ValueError(f"pipeline.checkpointing={p.checkpointing} names stages outside 0..{chunks - 1}")
        if p.recomputed_units is not None and (len(p.recomputed_units) != chunks or min(p.recomputed_units) < 0):
            raise ValueError(f"pipeline.recomputed_units = {p.recomputed_units}: give one count (0 or more) for each "
                             f"of the {chunks} stages")
        return self

    @property
    def world_size(self) -> int:
        return self.pipeline.stages * self.pipeline.data_parallel * self.pipeline.sequence_parallel

    @property
    def micro_batch_size(self) -> int:
        return self.train.batch_size // (self.pipeline.microbatches * self.pipeline.data_parallel)

    @property
    def quantised_base(self) -> str | None:
        """The format this config holds its frozen linear weights in where it quantises them (fp8, int8, nf4; fp8
        with train.fp8_compute = true, "auto" being undecided here); None where it does not."""
        if self.train.fp8_compute is True and self.adapter.type != "none":
            return "fp8"
        return self.memory.base_dtype if self.memory.base_dtype in ("fp8", "int8", "nf4") else None

    @property
    def whole_tensors(self) -> str | None:
        """What this config holds as whole tensors, which sharded replicas cannot cut (a quantised base's scale per
        row, 8-bit moments), in words; None where nothing."""
        if self.quantised_base:
            return f"a base held in {self.quantised_base} (memory.base_dtype)"
        eight_bit = self.memory.optimizer_state == "8bit"
        return "8-bit AdamW moments (memory.optimizer_state = \"8bit\")" if eight_bit else None


def fp8_compute_problem(config: "RunConfig") -> str | None:
    """Why this run cannot take train.fp8_compute, in one line (a frozen base held in fp8, bf16 compute: the fp8
    kernels' output, replicas that keep whole weights); None where it can."""
    if config.adapter.type == "dora":
        return ("train.fp8_compute runs a frozen base's products in fp8, and adapter.type = \"dora\" reads the whole "
                "base weight in every step (peft's DoRA norm): set train.fp8_compute = false, or train lora, loha or "
                "lokr")
    if config.adapter.type == "none" and config.pipeline.data_parallel_shard and config.pipeline.data_parallel > 1:
        return ("train.fp8_compute on a full fine-tune (torchao's float8 training) is not tested on sharded replicas "
                "here: set pipeline.data_parallel_shard = false, or train.fp8_compute = false")
    if config.adapter.type != "none" and config.memory.base_dtype not in ("auto", "fp8"):
        return (f"train.fp8_compute computes with the frozen weights stored in fp8, and memory.base_dtype = "
                f"\"{config.memory.base_dtype}\": set memory.base_dtype = \"fp8\" (or \"auto\"), or "
                "train.fp8_compute = false")
    if config.train.precision != "bf16":
        return (f"train.fp8_compute gives bf16 products (what fp8 kernels with a scale per row return), and "
                f"train.precision = \"{config.train.precision}\": set train.precision = \"bf16\", or "
                "train.fp8_compute = false")
    return None


# train.optimizer_args each optimizer takes (train/optim.py, train/prodigy.py)
OPTIMIZER_ARGS = {"adamw": (), "adafactor": ("clip_threshold", "decay_rate", "beta1", "scale_parameter"),
                  "prodigy": ("d_coef", "d0", "growth_rate", "beta3", "use_bias_correction", "safeguard_warmup")}


def _check_optimizer(t: TrainConfig, memory: MemoryConfig, p: PipelineConfig) -> None:
    unknown = sorted(set(t.optimizer_args) - set(OPTIMIZER_ARGS[t.optimizer]))
    if unknown:
        takes = ", ".join(OPTIMIZER_ARGS[t.optimizer]) or "none"
        raise ValueError(f"train.optimizer_args: {', '.join(unknown)} is not a setting of train.optimizer = "
                         f"{t.optimizer!r} (it takes: {takes})")
    if t.optimizer == "adamw":
        return
    if memory.optimizer_state != "fp32":
        raise ValueError(f"memory.optimizer_state = {memory.optimizer_state!r} is AdamW's (bitsandbytes' AdamW8bit) "
                         f"and train.optimizer is {t.optimizer!r}: set memory.optimizer_state = \"fp32\" or "
                         "train.optimizer = \"adamw\"")
    if p.data_parallel_shard and p.data_parallel > 1:
        raise ValueError(f"train.optimizer = {t.optimizer!r} needs each weight whole (Adafactor's row and column "
                         "means, Prodigy's sums), which pipeline.data_parallel_shard cuts across replicas: set "
                         "pipeline.data_parallel_shard = false, or train.optimizer = \"adamw\"")
    if t.optimizer == "adafactor" and p.data_parallel > 1 and p.stages > 1:
        raise ValueError("train.optimizer = \"adafactor\" with data-parallel replicas of a pipeline: their weights "
                         "are DTensors (FSDP2's replicate), which transformers' Adafactor cannot step. Use "
                         "pipeline.stages = 1 with data parallel (torch's DDP engine), pipeline.data_parallel = 1, "
                         "or train.optimizer = \"prodigy\" or \"adamw\"")
    if t.optimizer == "prodigy" and t.stage_lr_scale is not None and len(set(t.stage_lr_scale)) > 1:
        raise ValueError("train.optimizer = \"prodigy\" estimates one step size for the whole model, so stages "
                         "cannot have learning rates of their own: leave train.stage_lr_scale unset, or use adamw")


def _describe(error: dict, model: type[BaseModel]) -> str:
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        section = model
        for part in error["loc"][:-1]:
            field = section.model_fields.get(str(part))
            section = field.annotation if field and isinstance(field.annotation, type) else None
            if section is None or not issubclass(section, BaseModel):
                break
        known = sorted(section.model_fields) if section is not None and issubclass(section, BaseModel) else []
        close = difflib.get_close_matches(str(error["loc"][-1]), known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"{key}: unknown key; {hint}known keys here: {', '.join(known)}"
    if not error["loc"]:
        return str(error["msg"]).removeprefix("Value error, ")
    return f"{key}: {error['msg']} (got {error.get('input')!r})"


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, for example --set train.max_steps=10")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as bf16 is a string
    return key.strip().split("."), value


def validate_config(data: dict[str, Any], overrides: list[str] = ()) -> RunConfig:
    """Validate a config mapping after applying `section.key=value` overrides: the schema alone (what a model folder
    decides, config_files.build_config adds)."""
    for text in overrides:
        path, value = _parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {part} is not a section")
        node[path[-1]] = value
    try:  # strict: "64" is not 64 (a quoted --set value is a string); an int is still a valid float
        return RunConfig.model_validate(data, strict=True)
    except ValidationError as exc:
        lines = [_describe(e, RunConfig) for e in exc.errors()]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def make_paths_absolute(config: RunConfig) -> RunConfig:
    """model.path, the text encoder folder and the data folders as absolute paths (from the working directory), so
    that the run folder's config.toml serves `sample`, `export` and `--resume` from any directory."""
    def absolute(value):
        if isinstance(value, list):
            return [absolute(v) for v in value]
        return str(Path(value).expanduser().absolute()) if value else value

    m, d = config.model, config.data
    m.path = absolute(m.path)
    if m.text_encoder != "tiny-clip":
        m.text_encoder = absolute(m.text_encoder)
    d.path, d.eval_path, d.cache_dir = absolute(d.path), absolute(d.eval_path), absolute(d.cache_dir)
    return config


def save_config(config: RunConfig, path: str | Path) -> None:
    """Write the resolved config (every default filled in) as TOML."""
    Path(path).write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
