"""Write a Flux-layout pipeline folder at FLUX.1-dev's widths with random weights in bf16, as large as asked: Flux's
transformer with --double and --single blocks, a CLIP-L text model, a T5 encoder of T5-XXL's width with --t5-layers
(24: T5-XXL's 4.7 B parameters, 9.5 GB in bf16, as FLUX.1-dev ships it), and Flux's VAE; the tokenizers are the
tiny ones of examples/make_tiny_pipeline.py (a small vocabulary; the widths are what cost memory). With --photos,
the sample photographs too. For measuring what a run holds on a card at its start (text encoders, VAE, stages)
without downloading FLUX.1-dev; weights are drawn on the GPU when there is one.

    python bench/write_flux_folder.py --out /tmp/flux_medium --double 4 --single 8 --t5-layers 24 --photos
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from make_tiny_pipeline import tiny_clip_tokenizer, tiny_t5_tokenizer, write_photos  # noqa: E402


def main() -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from diffpipe.models.families.flux.flux import FLUX_PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--double", type=int, default=4)
    parser.add_argument("--single", type=int, default=8)
    parser.add_argument("--t5-layers", type=int, default=24)
    parser.add_argument("--photos", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    torch.manual_seed(0)
    with torch.device(device):
        transformer = FluxTransformer2DModel(**dict(FLUX_PRESETS["dev"], num_layers=args.double,
                                                    num_single_layers=args.single))
        clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tokenizer), hidden_size=768, intermediate_size=3072,
                                            num_hidden_layers=12, num_attention_heads=12, projection_dim=768,
                                            max_position_embeddings=77))
        t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=4096, d_ff=10240, d_kv=64, num_heads=64,
                                     num_layers=args.t5_layers, feed_forward_proj="gated-gelu"))
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                            layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=0.3611, shift_factor=0.1159,
                            use_quant_conv=False, use_post_quant_conv=False)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=clip,
                        tokenizer=clip_tokenizer, text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer)
    pipe.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    if args.photos:
        write_photos(args.out)
    sizes = {name: sum(p.numel() for p in module.parameters()) / 1e9
             for name, module in (("transformer", transformer), ("clip", clip), ("t5", t5), ("vae", vae))}
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v:.2f} B" for k, v in sizes.items()), flush=True)


if __name__ == "__main__":
    main()
