"""Image folders on an SDXL-layout pipeline: how fast the cache builds, and training samples/s with cached latents
against the frozen VAE and text encoders run inside every step.

    python bench/folder_data.py --size real --out /tmp/folder_bench     # H200: real SDXL widths, 1024x1024 buckets
    python bench/folder_data.py --size tiny --out /tmp/folder_bench     # CPU dry run (the tiny pipeline, 128x128)
    python bench/folder_data.py --size real --out /tmp/fb --stages 2 --cached-only --skip cache  # 2 GPUs, per bucket

Writes a pipeline folder with random weights (real size: the SDXL UNet preset, SDXL's VAE config, CLIP ViT-L and
OpenCLIP bigG text-encoder configs, a small real CLIP tokenizer), and a folder of captioned photographs cut from
scikit-learn's two sample photos and resized to about the bucket area in three shapes. Prints JSON lines: the cache
build (images/s, first run and the reusing second run), then one training run each with `data.cache` true and
false (one stage, `diffpipe train` in a subprocess; median samples/s over the steps after the first two).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffpipe.config_files import build_config  # noqa: E402
from diffpipe.data.preparation import prepare_folder_images  # noqa: E402
from diffpipe.models.families.unet.text import PipelineText  # noqa: E402
from diffpipe.models.vae import load_vae  # noqa: E402

_SHAPES = {"real": [(1024, 1024), (1216, 832), (832, 1216)], "tiny": [(128, 128), (160, 96), (96, 160)]}


def _tiny_script():
    spec = importlib.util.spec_from_file_location("make_tiny_pipeline", ROOT / "examples" / "make_tiny_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_real_sdxl(out: Path) -> Path:
    """The SDXL pipeline's architecture at full width with random weights, saved in fp16 as the Hub's are."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from diffpipe.models.families.unet.presets import UNET_PRESETS

    script = _tiny_script()
    tokenizer = script.tiny_clip_tokenizer()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # random initialisation of 3.5 B parameters is minutes on a CPU, seconds here
        unet = UNet2DConditionModel(**UNET_PRESETS["sdxl"])
        vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=4,
                            sample_size=1024, scaling_factor=0.13025, force_upcast=True)
        common = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=1)
        clip_l = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                              num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu",
                                              **common))
        big_g = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=1280, intermediate_size=5120,
                                                           num_hidden_layers=32, num_attention_heads=20,
                                                           projection_dim=1280, hidden_act="gelu", **common))
    parts = [m.to("cpu", torch.float16) for m in (unet, vae, clip_l, big_g)]
    scheduler = EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                       beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(vae=parts[1], text_encoder=parts[2], text_encoder_2=parts[3], tokenizer=tokenizer,
                                     tokenizer_2=tokenizer, unet=parts[0], scheduler=scheduler)
    pipe.save_pretrained(out / "sdxl", safe_serialization=True)
    return out / "sdxl"


def write_images(out: Path, count: int, shapes: list[tuple[int, int]]) -> Path:
    """`count` crops of the two sample photos, resized to the given shapes (10 % larger: the buckets crop)."""
    from PIL import Image

    try:
        from sklearn.datasets import load_sample_images
        photos = [Image.fromarray(pixels) for pixels in load_sample_images().images]
    except ImportError:  # a machine without scikit-learn: the whole photos, as examples/make_tiny_pipeline.py wrote them
        photos = [Image.open(ROOT / "examples" / "tiny" / "photos" / f"{name}_0.jpg") for name in ("china", "flower")]
    folder = out / "images"
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(count):
        image = photos[i % 2]
        width, height = shapes[i % len(shapes)]
        left, top = (int(v) for v in torch.randint(0, 200, (2,), generator=gen))
        crop = image.crop((left, top, left + 440, top + 227)) if width > height else image.crop(
            (left, 0, left + 300, 427)) if height > width else image.crop((left, 0, left + 427, 427))
        crop.resize((int(width * 1.1), int(height * 1.1)), Image.BICUBIC).save(folder / f"{i:04d}.jpg", quality=90)
        (folder / f"{i:04d}.txt").write_text(["a photo of the chinese temple", "a close photo of a pink flower"][i % 2])
    return folder


def _data(size: str, folder: Path, images: Path, cache: bool) -> dict:
    real = size == "real"
    return {"model": {"path": str(folder)},
            "data": {"dataset": "folder", "path": str(images), "resolution": 1024 if real else 128,
                     "bucket_step": 64 if real else 32, "cache": cache},
            "train": {"precision": "bf16" if real else "fp32", "batch_size": 8, "max_steps": 10, "learning_rate": 1e-5},
            "pipeline": {"stages": 1, "microbatches": 8 if real else 2},
            "observe": {"every": 10, "log_every": 0}, "checkpoint": {"every": 0},
            "output": {"save_weights": False, "sample_every_end": False}}


def bench_cache(size: str, folder: Path, images: Path) -> None:
    config = build_config(_data(size, folder, images, True))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    text = PipelineText.from_folder(folder).to(device)
    vae = load_vae(folder).to(device)
    count = len(list(images.glob("*.jpg")))
    for attempt in ("first", "reused"):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        data = prepare_folder_images(config.data, folder, vae, text, show=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        print(json.dumps({"what": "cache", "run": attempt, "images": count, "seconds": round(seconds, 2),
                          "images_per_s": round(count / seconds, 2),
                          "buckets": {str(b): n for b, n in sorted(data.bucket_counts().items())}}), flush=True)


def bench_training(size: str, folder: Path, images: Path, out: Path, steps: int, stages: int, uncached: bool) -> None:
    for cache in (True, False) if uncached else (True,):
        config = _data(size, folder, images, cache)
        config["train"]["max_steps"] = steps
        config["pipeline"]["stages"] = stages
        config["observe"]["every"] = 1 if stages > 1 else 10  # several stages: every step's peak memory, per bucket
        config_file = out / f"train_cache_{cache}.json"
        sets = [f"{section}.{key}={json.dumps(value)}" for section, keys in config.items() for key, value in keys.items()]
        run = out / f"run_cache_{cache}"
        cmd = [sys.executable, "-m", "diffpipe", "train", str(ROOT / "examples" / "photos.toml"), "--output-dir", str(run),
               "--overwrite"] + [arg for s in sets for arg in ("--set", s)] + ["--set", "sample.prompts=[]"]
        config_file.write_text(json.dumps(config))
        start = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if result.returncode != 0:
            print(json.dumps({"what": "train", "cache": cache, "error": result.stderr[-2000:]}), flush=True)
            continue
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rates = [r["samples_per_s"] for r in rows[2:]]
        peaks = {}  # bucket -> the largest peak of each stage over its steps
        for r in rows:
            stage_peaks = [r.get(f"stage{s}_peak_gib", 0.0) for s in range(stages)]
            peaks[r["bucket"]] = [round(max(a, b), 2) for a, b in zip(peaks.get(r["bucket"], stage_peaks), stage_peaks)]
        print(json.dumps({"what": "train", "cache": cache, "stages": stages, "steps": len(rows), "wall_s": round(wall, 1),
                          "peak_gib_per_stage_by_bucket": peaks,
                          "median_step_s": round(statistics.median(r["step_time_s"] for r in rows[2:]), 4),
                          "median_samples_per_s": round(statistics.median(rates), 2),
                          "final_loss": rows[-1]["loss"]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["real", "tiny"], default="real")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: cache,train")
    parser.add_argument("--stages", type=int, default=1, help="pipeline stages (one GPU each)")
    parser.add_argument("--cached-only", action="store_true", help="train only with the cache (not also without)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    folder = write_real_sdxl(out) if args.size == "real" else _tiny_script().write_sdxl(out)
    images = write_images(out, args.images, _SHAPES[args.size])
    print(json.dumps({"what": "setup", "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    if "cache" not in args.skip:
        bench_cache(args.size, folder, images)
    if "train" not in args.skip:
        bench_training(args.size, folder, images, out, args.steps, args.stages, not args.cached_only)


if __name__ == "__main__":
    main()
