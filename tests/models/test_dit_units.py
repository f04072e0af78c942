"""The Flux, Flux Kontext, Chroma, SD3, Wan and Qwen-Image adapters' units, run in order and as stages, compute exactly diffusers' forward, and the
families' latent layouts are what diffusers' pipelines use (packing, unpatchifying) and invert exactly."""
from __future__ import annotations

import pytest
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

from diffpipe.models.families.flux.chroma import CHROMA_PRESETS, ChromaFamily
from diffpipe.models.family import Feed
from diffpipe.models.families.flux.flux import FluxFamily
from diffpipe.models.families.flux.kontext import FluxKontextFamily
from diffpipe.models.families.qwen_image.qwen_image import QWEN_IMAGE_PRESETS, QwenImageFamily
from diffpipe.models.families.qwen_image.edit import QwenImageEditFamily
from diffpipe.models.families.sd3.sd3 import SD3Family
from diffpipe.models.families.unet.unet3d import UNET3D_PRESETS, UNet3DFamily
from diffpipe.models.families.wan.wan import WAN_PRESETS, WanFamily
from diffpipe.models.families.wan.i2v import WanI2VFamily
from diffpipe.pipeline.split import stage_specs
from diffpipe.pipeline.stage import build_stage_modules
from diffpipe.sampling import run_stages

FLUX = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=20, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6))
SD3 = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2,
           joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=20, out_channels=4,
           pos_embed_max_size=16)
SD35 = dict(SD3, qk_norm="rms_norm", dual_attention_layers=(0,))  # SD3.5's per-head norms, MMDiT-X's extra attention
WAN = dict(WAN_PRESETS["digits"], in_channels=4, out_channels=4, text_dim=24, num_layers=3)
QWEN = dict(QWEN_IMAGE_PRESETS["digits"], in_channels=16, out_channels=4, joint_attention_dim=24)
CHROMA = dict(CHROMA_PRESETS["digits"], in_channels=16, joint_attention_dim=24, num_single_layers=3)
CASES = {"flux": (FluxFamily(), FLUX), "flux-kontext": (FluxKontextFamily(), FLUX), "chroma": (ChromaFamily(), CHROMA),
         "sd3": (SD3Family(), SD3), "sd3.5-style": (SD3Family(), SD35),
         "wan": (WanFamily(), WAN), "wan-i2v": (WanI2VFamily(), dict(WAN, in_channels=4 + 4 + 4)),
         "wan-ti2v-i2v": (WanI2VFamily(), WAN),  # TI2V-5B's: the first frame replaced, its timestep zero
         # Wan 2.1 I2V's: a CLIP embedding of the picture before the text (7 positions, padded to the model's 512)
         "wan21-i2v": (WanI2VFamily(), dict(WAN, in_channels=4 + 4 + 4, image_dim=10, added_kv_proj_dim=48)),
         "qwen-image": (QwenImageFamily(), QWEN),
         "qwen-image-edit": (QwenImageEditFamily(), QWEN),
         "qwen-image-edit-2511": (QwenImageEditFamily(), dict(QWEN, zero_cond_t=True)),  # the control at time zero
         "unet3d": (UNet3DFamily(), dict(UNET3D_PRESETS["digits"], in_channels=4,
                                                                          out_channels=4, cross_attention_dim=24))}
SIZES = {"wan": (3, 8, 12), "wan-i2v": (3, 8, 12), "wan-ti2v-i2v": (3, 8, 12), "wan21-i2v": (3, 8, 12), "unet3d": (3, 8, 12)}  # frames, height, width of a clip


def _fed(family, model, size=(8, 12), batch=3):  # noqa: C901
    """A batch as the batch maker feeds it: latents in the family's layout, its named conditions, timesteps; an edit
    family's control latents at another size than the picture's (the pipeline allows it)."""
    gen = torch.Generator().manual_seed(0)
    cfg = model.config
    latents = torch.randn(batch, family.latent_channels(cfg), *size, generator=gen)
    hidden, pooled = family.text_widths(cfg)
    feed = Feed(family, cfg, guidance=3.5)
    control = torch.randn(batch, family.latent_channels(cfg), 6, 8, generator=gen) if family.reads_control else None
    if family.reads_first_frame:  # a clip's first frame encoded: the clip's size
        control = torch.randn(batch, family.latent_channels(cfg), *size, generator=gen)
    conditions = feed.conditions(torch.randn(batch, 7, hidden, generator=gen), torch.randn(batch, pooled, generator=gen),
                                 torch.zeros(batch, 6), size, control=control)
    conditions["timestep"] = torch.tensor([0.0, 417.0, 999.0][:batch])
    return feed, latents, conditions


@pytest.mark.parametrize("name", CASES)
def test_units_in_order_and_as_stages_equal_diffusers_forward(name):
    family, config = CASES[name]
    size = SIZES.get(name, (8, 12))
    torch.manual_seed(0)
    model = family.model_class(**config).eval()
    backbone = family.describe(model, "layers")
    feed, latents, conditions = _fed(family, model, size)
    with torch.no_grad():
        expected = family.diffusers_forward(model, feed.pack(latents), conditions)
        units = backbone.forward({"sample": feed.pack(latents)}, conditions)
        staged = run_stages(build_stage_modules(backbone, stage_specs(backbone, [1, 3, len(backbone.units) - 1])),
                            feed.pack(latents), conditions)
    assert torch.equal(staged, units)
    if name == "wan-ti2v-i2v":  # modulated a frame at a time, not a token at a time: a float's rounding apart
        torch.testing.assert_close(units, expected, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(units, expected)
    if name in ("sd3", "sd3.5-style", "wan"):  # SD3's and Wan's forward unpatchify: the prediction as latents is exactly diffusers' output
        pooled = {k: conditions[k] for k in ("pooled_projections",) if k in conditions}
        plain = model(hidden_states=latents, timestep=conditions["timestep"], return_dict=False,
                      encoder_hidden_states=conditions["encoder_hidden_states"], **pooled)[0]
        assert torch.equal(feed.unpack_prediction(units, size), plain)


@pytest.mark.parametrize("name", ["flux", "chroma", "sd3", "wan", "qwen-image"])
def test_prediction_layout_inverts_exactly(name):
    family, config = CASES[name]
    size = SIZES.get(name, (8, 12))
    with torch.device("meta"):
        cfg = family.model_class(**config).config
    latents = torch.randn(2, family.latent_channels(cfg), *size)
    feed = Feed(family, cfg)
    assert torch.equal(feed.unpack_prediction(feed.pack_prediction(latents), size), latents)


def test_flux_packing_is_diffusers_pipeline_packing():
    from diffusers import FluxPipeline

    latents = torch.randn(2, 4, 8, 12)
    packed = FluxPipeline._pack_latents(latents, 2, 4, 8, 12)
    feed = Feed(FluxFamily(), FluxTransformer2DModel(**dict(FLUX, num_layers=1, num_single_layers=1)).config)
    assert torch.equal(feed.pack(latents), packed)
    ids = FluxPipeline._prepare_latent_image_ids(2, 4, 6, "cpu", torch.float32)
    text = feed.conditions(torch.zeros(2, 5, 24), torch.zeros(2, 20), torch.zeros(2, 6), (8, 12))
    assert torch.equal(text["img_ids"][1], ids) and text["txt_ids"].shape == (2, 5, 3)


def test_the_sd3_positional_table_is_rebuilt_on_a_meta_model():
    family = SD3Family()
    real = SD3Transformer2DModel(**SD3)
    with torch.device("meta"):
        meta = SD3Transformer2DModel(**SD3)
    assert torch.equal(family.constructor_buffers(meta)["pos_embed.pos_embed"], real.pos_embed.pos_embed)


def test_the_wan_rotary_tables_are_rebuilt_on_a_meta_model():
    family = WanFamily()
    real = family.model_class(**WAN)
    with torch.device("meta"):
        meta = family.model_class(**WAN)
    rebuilt = family.constructor_buffers(meta)
    assert set(rebuilt) == {name for name, _ in real.named_buffers()}
    assert all(torch.equal(rebuilt[name], buffer) for name, buffer in real.named_buffers())


@pytest.mark.parametrize("name", ["flux", "chroma"])
def test_single_blocks_hand_their_attention_a_contiguous_gradient(name):
    """A Flux (or Chroma) single block joins its attention's output with its MLP's along the channels, so the
    gradient reaching the attention would be a strided slice, which cuDNN's attention fails on after a double block's
    contiguous one (an H100: bench/flux_cudnn_probe.py); the units hand it back contiguous, every single block's.
    A model described twice (1 and 2 stages of one model) keeps one hook a block: a second would copy again."""
    family, config = CASES[name]
    model = family.model_class(**config).train()
    family.describe(model, "layers")
    backbone = family.describe(model, "layers")
    assert all(len(block.attn._forward_hooks) == 1 for block in model.single_transformer_blocks)
    reached = []  # the gradient of each single block's attention output, as the attention's backward gets it

    def watch(module, args, out):
        out.register_hook(reached.append)

    for block in model.single_transformer_blocks:
        block.attn.register_forward_hook(watch, prepend=True)
    feed, latents, conditions = _fed(family, model)
    named = {"sample": feed.pack(latents), **conditions}
    for unit in backbone.units:
        named.update(unit(named))
    named[backbone.output].square().mean().backward()
    assert len(reached) == config["num_single_layers"]
    assert all(grad.is_contiguous() for grad in reached), [grad.stride() for grad in reached]
