"""fp8 attention: self-attention's two products and their gradients on fp8 tensor cores (issue 54: at Wan 14B's
32,760 tokens attention is most of a LoRA step, and the plain loop runs the same bf16 cuDNN kernels diffpipe does).

`attend_fp8(q, k, v, maxima)` computes softmax(q k^T * scale) v as cuDNN's fp8 flash-attention kernels do, forward
and backward: on a GPU through NVIDIA's cudnn-frontend (`pip install 'diffpipe[fp8-attention]'`; torch's
scaled_dot_product_attention takes no fp8), on a CPU in fp32 from the same fp8 operands (`_reference_forward`,
`_reference_backward`: the kernels' arithmetic written out, for tests; the kernels sum in another order).

The arithmetic, each operand with one scale for the whole tensor (e4m3: 448 at most, 3 bits of mantissa):
- forward: q, k and v are scaled by their own absolute maxima into e4m3 ("current" scaling); S = q k^T (fp32 sums),
  P = softmax(S * scale), P in e4m3 at 448 (it lies in [0, 1]), O = P v, and O in e4m3 at v's scale (each row of O
  averages rows of v, so |O| <= max |v|), handed on in the model's dtype;
- backward: the output's gradient dO by its own maximum; dV = P^T dO, dP = dO v^T, dS = P (dP - rowsum(dO O)),
  dS in e4m3, dQ = dS k * scale and dK = dS^T q * scale. dS, dQ, dK and dV are scaled by the maxima the kernels
  reported for them on the module's previous backward ("delayed" scaling, Transformer Engine's recipe; `maxima`, a
  buffer of the attention module, times 2 for headroom). Where this backward's maxima left that range (a gradient
  4x the last one saturates; 16x smaller leaves most of e4m3's values unused; before the first backward there are
  none) it runs again at their scales: diffusion's gradients change size with each sample's timestep.

`attend_in_fp8(module, processors)` (train.fp8_attention) hands the attentions of a stage's modules their family's
fp8 processors (`ModelFamily.fp8_attention_processors`: Wan's, models/families/wan/attention.py), which run their
self-attention so; cross-attention to the text stays in bf16.
"""
from __future__ import annotations

import copy
import functools

import torch
from torch import Tensor, nn

from ..errors import ConfigError

__all__ = ["E4M3_MAX", "attend_fp8", "quantised", "attend_in_fp8", "fp8_attention_problem", "fp8_attention_words"]

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
_HEADROOM = 2.0  # delayed scales leave room for a maximum twice the last one
_PASSES = 3  # a backward whose maxima left its scales' range runs again at theirs: dS's, then dQ's and dK's (products
# of dS in e4m3) settle by the third
_MAXIMA = ("dQ", "dK", "dV", "dS")  # the order of a module's `maxima` buffer


def quantised(t: Tensor, descale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`t` in e4m3 with one scale for the whole tensor, and the factor that undoes it: by default t's maximum maps
    to 448; given `descale`, values past 448 * descale saturate."""
    if descale is None:
        descale = (t.detach().abs().amax().float() / E4M3_MAX).clamp(min=1e-30)
    return (t.float() / descale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), descale.reshape(())


def _in_fp8_at_448(probabilities: Tensor) -> Tensor:
    """P as the kernels' products read it: in e4m3 at 448 (P lies in [0, 1]), back in fp32."""
    p8, descale = quantised(probabilities, probabilities.new_tensor(1 / E4M3_MAX))
    return p8.float() * descale


def _reference_forward(q8, k8, v8, descales: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """O in e4m3 and the rows' log-sum-exp, in fp32 from the fp8 operands (B, H, S, D)."""
    dq, dk, dv = descales[0], descales[1], descales[2]
    logits = (q8.float() @ k8.float().transpose(-1, -2)) * (dq * dk * scale)
    stats = torch.logsumexp(logits, dim=-1, keepdim=True)
    out = _in_fp8_at_448(torch.exp(logits - stats)) @ (v8.float() * dv)
    return quantised(out, dv)[0], stats


def _reference_backward(grad8, q8, k8, v8, o8, stats, descales: Tensor, delayed: Tensor, scale: float):
    """dQ, dK, dV in e4m3 at the delayed scales, and the maxima of dQ, dK, dV and dS, in fp32 as the kernels
    compute them (P recomputed from the forward's log-sum-exp)."""
    q, k, v = (t.float() * d for t, d in zip((q8, k8, v8), descales[:3]))
    out, grad = o8.float() * descales[2], grad8.float() * descales[3]  # O at v's scale
    probabilities = torch.exp(q @ k.transpose(-1, -2) * scale - stats)
    d_v = _in_fp8_at_448(probabilities).transpose(-1, -2) @ grad
    d_s = probabilities * (grad @ v.transpose(-1, -2) - (grad * out).sum(-1, keepdim=True))
    ds8, descale_ds = quantised(d_s, delayed[3])
    d_q, d_k = (ds8.float() @ k) * (descale_ds * scale), (ds8.float().transpose(-1, -2) @ q) * (descale_ds * scale)
    maxima = torch.stack([t.abs().amax() for t in (d_q, d_k, d_v, d_s)])
    return [quantised(t, d)[0] for t, d in zip((d_q, d_k, d_v), delayed[:3])], maxima


@torch.library.custom_op("diffpipe::fp8_attention_forward", mutates_args=())
def _forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                     Tensor, Tensor]:
    """(output in q's dtype, q8, k8, v8, o8, log-sum-exp of each row, the descales of q, k and v) for contiguous
    q, k, v (B, H, S, D)."""
    (q8, dq), (k8, dk), (v8, dv) = (quantised(t) for t in (q, k, v))
    descales = torch.stack([dq, dk, dv])
    if q.device.type == "cuda":
        o8, stats = _kernels(tuple(q.shape), scale, q.device.index).forward(q8, k8, v8, descales)
    else:
        o8, stats = _reference_forward(q8, k8, v8, descales, scale)
    return (o8.float() * dv).to(q.dtype), q8, k8, v8, o8, stats, descales


@_forward.register_fake
def _(q, k, v, scale):
    fp8 = [torch.empty_like(t, dtype=torch.float8_e4m3fn) for t in (q, k, v, q)]
    return (torch.empty_like(q), *fp8, q.new_empty(*q.shape[:-1], 1, dtype=torch.float32),
            q.new_empty(3, dtype=torch.float32))


@torch.library.custom_op("diffpipe::fp8_attention_backward", mutates_args=("maxima",))
def _backward(grad: Tensor, q8: Tensor, k8: Tensor, v8: Tensor, o8: Tensor, stats: Tensor, descales: Tensor,
              maxima: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV in grad's dtype from the forward's fp8 operands; `maxima` (the module's buffer) takes this
    backward's maxima of dQ, dK, dV and dS."""
    grad8, descale_grad = quantised(grad)
    descales = torch.cat([descales, descale_grad.reshape(1)])
    for _ in range(_PASSES):
        delayed = _delayed(maxima)
        grads8, found = _run_backward(grad8, q8, k8, v8, o8, stats, descales, delayed, scale)
        maxima.copy_(found)
        if _in_range(found, delayed):
            break
    return tuple((g.float() * d).to(grad.dtype) for g, d in zip(grads8, delayed[:3]))


@_backward.register_fake
def _(grad, q8, k8, v8, o8, stats, descales, maxima, scale):
    return tuple(torch.empty_like(grad) for _ in range(3))


def _delayed(maxima: Tensor) -> Tensor:
    """The descales of dQ, dK, dV and dS from their last maxima, with headroom."""
    return (maxima * _HEADROOM / E4M3_MAX).clamp(min=1e-30)


def _in_range(found: Tensor, delayed: Tensor) -> bool:
    """Whether each of this backward's maxima fitted the scales it ran at: none past e4m3's largest (saturated),
    none below a sixteenth of the headroom's mark (most of the 3-bit values' range unused), unless it is zero (a
    gradient of zeros: no scale represents it better)."""
    mapped = found / delayed
    return bool(((mapped <= E4M3_MAX) & ((mapped >= E4M3_MAX / _HEADROOM / 16) | (found == 0))).all())


def _run_backward(grad8, q8, k8, v8, o8, stats, descales, delayed, scale):
    if grad8.device.type == "cuda":
        kernels = _kernels(tuple(grad8.shape), scale, grad8.device.index)
        return kernels.backward(grad8, q8, k8, v8, o8, stats, descales, delayed)
    return _reference_backward(grad8, q8, k8, v8, o8, stats, descales, delayed, scale)


class _Attend(torch.autograd.Function):
    """The two custom ops as one differentiable function, the module's `maxima` handed to the backward."""

    @staticmethod
    def forward(ctx, q, k, v, maxima, scale):
        out, *saved = _forward(q, k, v, scale)
        # the buffer rides on ctx, not among the saved tensors: each micro-batch's backward updates it, which would
        # fail autograd's check on a saved tensor changed since
        ctx.maxima, ctx.scale = maxima, scale
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (*_backward(grad.contiguous(), *ctx.saved_tensors, ctx.maxima, ctx.scale), None, None)


def attend_fp8(q: Tensor, k: Tensor, v: Tensor, maxima: Tensor, scale: float | None = None) -> Tensor:
    """softmax(q k^T * scale) v with its products in fp8 (the module docstring's arithmetic); q, k, v (B, H, S, D),
    the same heads and tokens; `maxima` a (4,) fp32 buffer of the attention module, zeros before its first backward."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _Attend.apply(*(t.contiguous() for t in (q, k, v)), maxima, scale)


@functools.cache
def _kernels(shape: tuple[int, ...], scale: float, device: int) -> "_CudnnAttention":
    """cuDNN's fp8 graphs for one shape on one GPU, built once per process (building one takes its heuristics'
    time)."""
    with torch.cuda.device(device):
        return _CudnnAttention(shape, scale)


class _CudnnAttention:
    """cuDNN's fp8 forward and backward graphs (cudnn-frontend's `sdpa_fp8`, `sdpa_fp8_backward`) for contiguous
    (B, H, S, D) operands, e4m3 in and out, scales as one-element fp32 tensors."""

    _FORWARD_SCALES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    _BACKWARD_SCALES = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                        "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")

    def __init__(self, shape: tuple[int, ...], scale: float):
        import cudnn

        fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        self.shape = shape
        like = torch.empty(shape, device="cuda", dtype=torch.uint8)
        stats = torch.empty(*shape[:3], 1, device="cuda")
        one = torch.ones(1, 1, 1, 1, device="cuda")

        def output(node, tensor, dtype):
            node.set_output(True).set_dim(list(tensor.shape)).set_stride(list(tensor.stride())).set_data_type(dtype)

        def graph():
            return cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32)

        forward = graph()
        self.f = {name: forward.tensor_like(like).set_data_type(fp8) for name in ("q", "k", "v")}
        self.f.update({name: forward.tensor_like(one) for name in self._FORWARD_SCALES})
        nodes = forward.sdpa_fp8(**self.f, is_inference=False, attn_scale=scale, use_causal_mask=False)
        for name, node, tensor, dtype in zip(("o", "stats", "amax_s", "amax_o"), nodes, (like, stats, one, one),
                                             (fp8, f32, f32, f32)):
            output(node, tensor, dtype)
            self.f[name] = node
        backward = graph()
        self.b = {name: backward.tensor_like(like).set_data_type(fp8) for name in ("q", "k", "v", "o", "dO")}
        self.b["stats"] = backward.tensor_like(stats)
        self.b.update({name: backward.tensor_like(one) for name in self._BACKWARD_SCALES})
        nodes = backward.sdpa_fp8_backward(**self.b, attn_scale=scale, use_causal_mask=False)
        for name, node in zip(("dQ", "dK", "dV", "amax_dQ", "amax_dK", "amax_dV", "amax_dP"), nodes):
            output(node, like if name in ("dQ", "dK", "dV") else one, fp8 if name in ("dQ", "dK", "dV") else f32)
            self.b[name] = node
        try:
            for built in (forward, backward):
                built.validate()
                built.build_operation_graph()
                built.create_execution_plans([cudnn.heur_mode.A])
                built.check_support()
                built.build_plans()
        except Exception as error:  # cudnn-frontend's own errors name no setting
            raise ConfigError(f"train.fp8_attention: cuDNN {cudnn.backend_version()} has no fp8 attention kernel for "
                              f"queries of shape {list(shape)} (batch, heads, tokens, head size) on "
                              f"{torch.cuda.get_device_name()}: {str(error).splitlines()[0][:300]}. Set "
                              "train.fp8_attention = false") from None
        self.graphs = forward, backward
        self.workspace = torch.empty(max(forward.get_workspace_size(), backward.get_workspace_size()),
                                     device="cuda", dtype=torch.uint8)
        self.p_scale, self.p_descale = one * E4M3_MAX, one / E4M3_MAX  # P in [0, 1] maps onto e4m3's range

    @staticmethod
    def _scalar(value: Tensor) -> Tensor:
        return value.float().reshape(1, 1, 1, 1).contiguous()

    def forward(self, q8, k8, v8, descales) -> tuple[Tensor, Tensor]:
        o8 = torch.empty(self.shape, device="cuda", dtype=torch.float8_e4m3fn)
        stats = torch.empty(*self.shape[:3], 1, device="cuda")
        s = self._scalar
        pack = {"q": q8, "k": k8, "v": v8, "o": o8, "stats": stats, "descale_q": s(descales[0]),
                "descale_k": s(descales[1]), "descale_v": s(descales[2]), "descale_s": self.p_descale,
                "scale_s": self.p_scale, "scale_o": s(1 / descales[2]),
                "amax_s": torch.empty(1, 1, 1, 1, device="cuda"), "amax_o": torch.empty(1, 1, 1, 1, device="cuda")}
        self.graphs[0].execute({self.f[n]: _bytes(t) for n, t in pack.items()}, self.workspace)
        return o8, stats

    def backward(self, grad8, q8, k8, v8, o8, stats, descales, delayed):
        grads = {name: torch.empty(self.shape, device="cuda", dtype=torch.float8_e4m3fn) for name in ("dQ", "dK", "dV")}
        maxima = {name: torch.empty(1, 1, 1, 1, device="cuda") for name in _MAXIMA}
        s = self._scalar
        pack = {"q": q8, "k": k8, "v": v8, "o": o8, "dO": grad8, "stats": stats, "descale_q": s(descales[0]),
                "descale_k": s(descales[1]), "descale_v": s(descales[2]), "descale_o": s(descales[2]),
                "descale_dO": s(descales[3]), "descale_s": self.p_descale,
                "scale_s": self.p_scale, "descale_dP": s(delayed[3]), "scale_dP": s(1 / delayed[3]),
                "scale_dQ": s(1 / delayed[0]), "scale_dK": s(1 / delayed[1]), "scale_dV": s(1 / delayed[2]),
                **grads, "amax_dQ": maxima["dQ"], "amax_dK": maxima["dK"], "amax_dV": maxima["dV"],
                "amax_dP": maxima["dS"]}
        self.graphs[1].execute({self.b[n]: _bytes(t) for n, t in pack.items()}, self.workspace)
        return [grads[name] for name in ("dQ", "dK", "dV")], torch.cat([maxima[n].reshape(1) for n in _MAXIMA])


def _bytes(t: Tensor) -> Tensor:
    """fp8 tensors as bytes (the frontend's convention for e4m3 operands), others as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def fp8_attention_problem(device: torch.device) -> str | None:
    """Why train.fp8_attention cannot run on this device, in one line; None where it can (a CPU runs the written-out
    arithmetic: for tests, slowly, its score matrix whole)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        return (f"train.fp8_attention runs cuDNN's fp8 flash-attention kernels, which need a Hopper or Blackwell GPU "
                f"(H100, H200, B200); {name} is not one: set train.fp8_attention = false")
    try:
        import cudnn  # noqa: F401 - NVIDIA's cudnn-frontend: torch's attention takes no fp8
    except ImportError:
        return ("train.fp8_attention runs cuDNN's fp8 flash-attention kernels through NVIDIA's cudnn-frontend, which "
                "is not installed: pip install 'diffpipe[fp8-attention]' (nvidia-cudnn-frontend), or set "
                "train.fp8_attention = false")
    return None


def _convertible(module: nn.Module, processors: dict[type, type]) -> list[nn.Module]:
    """The attentions in `module` whose processor's class `processors` maps to an fp8 subclass."""
    return [m for m in module.modules() if type(getattr(m, "processor", None)) in processors]


def attend_in_fp8(module: nn.Module, processors: dict[type, type], device: torch.device) -> int:
    """Give each attention in `module` whose processor's class `processors` maps (a family's
    `fp8_attention_processors`) that class's fp8 subclass, which runs its self-attention through `attend_fp8`, and a
    `fp8_attention_maxima` buffer of its own on `device`, where it computes (not saved with the weights; a swapped
    unit's weights lie in host memory); how many."""
    attentions = _convertible(module, processors)
    for attention in attentions:
        attention.register_buffer("fp8_attention_maxima", torch.zeros(4, device=device), persistent=False)
        processor = copy.copy(attention.processor)
        processor.__class__ = processors[type(processor)]  # the same settings, the subclass's call
        attention.set_processor(processor)
    return len(attentions)


def fp8_attention_words(model: nn.Module, processors: dict[type, type]) -> str:
    """What train.fp8_attention computes in fp8, for the run's header."""
    return (f"train.fp8_attention: the self-attention of {len(_convertible(model, processors))} attention layers "
            "runs on fp8 tensor cores (cuDNN's fp8 flash attention; cross-attention to the text in bf16)")
