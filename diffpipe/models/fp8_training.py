"""fp8 compute for a full fine-tune (train.fp8_compute with adapter.type = "none"): torchao's float8 training.

A full fine-tune's linear layers keep their fp32 weights (the optimizer's), and under bf16 autocast all three of
their products run on fp8 tensor cores: the forward, the input gradient and the weight gradient, each operand cast
to float8 (e4m3) with a scale per row as it enters (torchao's "rowwise" recipe, torchtitan's choice for accuracy;
the LoRA path's Fp8Product scales its operands the same way, models/stored_linear.py). torchao (pytorch/ao) is
PyTorch's own library for this; diffpipe swaps the layers with its `convert_to_float8_training` and nothing else.
Layers whose sides are not multiples of 16 stay bf16 (the fp8 kernels' rule); so does every other layer
(convolutions, norms, embeddings). On a GPU, so do layers too narrow for fp8 to pay (`fp8_pays`: torchao's own
thresholds for rowwise scales, from its H100 measurements): casting each operand costs more there than the faster
product saves. SDXL (1280 wide at most) keeps only its feed-forward input projections in fp8 so; Flux (3072) and Wan
(5120) nearly all their layers. An H100's SDXL full fine-tune with every layer in fp8 ran at 0.71x
`torch.compile(unet)` (docs/benchmarks.md). On a CPU (torch 2.13's fp8 kernel: for checking the arithmetic, not for
speed) every layer the kernels take is swapped.

The weight gradient's product runs over the input's rows (samples x tokens), which need not be a multiple of 16
(SDXL's cross-attention reads 77 text tokens: 616 rows at batch 8), so torchao pads the inner side of each product with
zero rows where it is not (its `pad_inner_dim`: a copy of the fp8 operand then).

torchao's conversion also applies its own workaround for a Triton fp8 miscompile to inductor's min/max code
(torchao/float8/_inductor_patch.py), for the process: the library's, where it chose to put it.
"""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from .stored_linear import fp8_computable, fp8_share_words

__all__ = ["RECIPE", "train_in_fp8", "fp8_training_words", "fp8_trainable", "fp8_pays"]

RECIPE = "rowwise"  # torchao's Float8LinearRecipeName: a scale per row of each operand


def fp8_pays(linear: nn.Linear) -> bool:
    """Whether a GPU's fp8 products make this layer's forward and backward faster than bf16's: torchao 0.18's
    thresholds for rowwise scales (torchao/float8/float8_linear_utils.py, `_auto_filter_for_rowwise`, measured on
    H100s: more than 2048 outputs, more than 1024 inputs, and not both at most 4096 and 2048)."""
    outputs, inputs = linear.out_features, linear.in_features
    return outputs > 2048 and inputs > 1024 and not (outputs <= 4096 and inputs <= 2048)


def fp8_trainable(module: nn.Module, device_kind: str) -> bool:
    """A plain linear layer with trained weights whose sides the fp8 kernels take (multiples of 16) and, on a GPU,
    wide enough for fp8 to pay."""
    return (type(module) is nn.Linear and module.weight.requires_grad and fp8_computable(module)
            and (device_kind != "cuda" or fp8_pays(module)))


def _contiguous_input(layer: nn.Module, args: tuple) -> tuple:
    return (args[0].contiguous(), *args[1:])


def train_in_fp8(module: nn.Module, device_kind: str) -> int:
    """Swap `module`'s fp8-trainable linear layers (on a `device_kind` device) for torchao's Float8Linear (the same
    weight and bias parameters, so names, the optimizer's state and checkpoints are unchanged), in place; how many
    were swapped.

    Each swapped layer is handed a contiguous input: Float8Linear flattens its input after casting it, and a cast
    with a scale per row cannot be copied (torchao 0.18: "aten.clone.default with axiswise scaling is not supported
    yet"), which a strided input needs (SDXL's transformers project a permuted (B, H*W, C) view: `proj_in`)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    count = sum(1 for m in module.modules() if fp8_trainable(m, device_kind))
    if count:
        config = replace(Float8LinearConfig.from_recipe_name(RECIPE), pad_inner_dim=True)
        convert_to_float8_training(module, config=config,
                                   module_filter_fn=lambda m, name: fp8_trainable(m, device_kind))
        from torchao.float8.float8_linear import Float8Linear

        for layer in module.modules():
            if isinstance(layer, Float8Linear):
                layer.register_forward_pre_hook(_contiguous_input)
    return count


def fp8_training_words(model: nn.Module, device_kind: str) -> str:
    """What a full fine-tune of `model` (built, on any device, before its layers are swapped) trains in fp8 on a
    `device_kind` device, for the run's header: its fp8-trainable linear layers, and the share of the trained linear
    layers' weights they hold."""
    linear = [m for m in model.modules() if type(m) is nn.Linear and m.weight.requires_grad]
    fp8 = [m for m in linear if fp8_trainable(m, device_kind)]
    narrow = ("; linear layers too narrow for fp8 to pay (torchao's thresholds) stay bf16 too" if device_kind == "cuda"
              else "")
    return (f"train.fp8_compute: {fp8_share_words(fp8, linear, 'trained')} train on fp8 tensor cores (torchao's "
            f"float8 training, {RECIPE} scales: the forward, input and weight gradients; the rest, convolutions "
            f"included, in bf16{narrow})")
