"""What families whose pipelines pack latents 2x2 into tokens outside the model share (Flux.1's, as
`tokens.pack_latents` packs them, and FLUX.2's): the model itself runs with patch_size = 1."""
from __future__ import annotations

from .family import ModelFamily
from .tokens import pack_latents, unpack_latents

__all__ = ["PackedFamily"]


class PackedFamily(ModelFamily):
    def check_supported(self, model):
        if model.config.patch_size != 1:
            raise ValueError(f"{type(model).__name__} config patch_size={model.config.patch_size} is not supported: "
                             "its pipelines pack latents 2x2 outside the model, with patch_size = 1")

    def latent_channels(self, cfg):
        return cfg.in_channels // 4

    def default_latent_size(self, cfg):
        """The configs carry no sample size: 128 (1024 pixels through the 8x VAE, what they train at); 1-channel
        configs are for digits."""
        return 8 if cfg.in_channels == 4 else 128

    def latent_multiple(self, cfg):
        return 2

    def pack(self, cfg, latents):
        return pack_latents(latents)

    def unpack_prediction(self, cfg, prediction, latent_size):
        return unpack_latents(prediction, latent_size)
