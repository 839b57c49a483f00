"""LoRA's frozen base held in 8 or 4 bits (bitsandbytes): `--quantize-base int8 | nf4`.

Models reach whisper-train in 32 bits from any folder (`models.load_model`: Hugging Face,
CTranslate2, OpenAI, a run's output), so the base is quantized after loading, here, not by
`from_pretrained`'s quantization_config. `prepare_model` calls `quantize_base` first, before
checkpointing and before peft wraps its adapters, so that peft puts its bnb LoRA layers around
the quantized ones. What is quantized: every linear layer inside the encoder's and the
decoder's layers (attention q/k/v/out and the feed-forward fc1/fc2, LoRA's targets or not). The
convolutional front end, the embeddings, the layer norms and the output head (tied to the
token embedding) stay as loaded.

peft's `prepare_model_for_kbit_training` is never called: it casts every 16-bit parameter to
32 bits (memory lost) and turns on checkpointing without `use_reentrant`, so torch's reentrant
default returns (docs/checkpointing.md, T2 and T9). Checkpointing stays `prepare_model`'s,
non-reentrant.

The 8-bit layers compute with their weights dequantized to the input's precision (8-bit
weights, as the 4-bit layers hold 4-bit ones), by `Int8WeightsLinear`, not by bitsandbytes'
own int8 autograd: that one keeps every layer's input on its autograd context (`ctx.A`,
`ctx.tensors`), outside the saved-tensor hooks through which checkpointing frees activations,
so under checkpointing each 8-bit layer's input would stay held from forward to backward.
The base is frozen: backward needs only the weights, never the input.

final/ does not merge into the quantized layers: `training.finish.whole_model` reloads the
base in full precision and merges the trained adapters there (merging into 4-bit weights
would add the update to the rounding error of every weight, and round it again).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator

import torch
from torch import nn

from whisper_train.choices import QUANTIZE_BASE
from whisper_train.errors import UserError
from whisper_train.memory.host import return_freed_memory

# NF4's block: one absmax per 64 weights (bitsandbytes' default), the absmaxes themselves
# quantized to 8 bits in blocks of 256 (double quantization).
NF4_BLOCK = 64
NF4_ABSMAX_BLOCK = 256
# Where bitsandbytes' layers run forward and backward.
SUPPORTED_DEVICES = ("cpu", "cuda", "xpu")
BNB_EXTRA = "pip install 'whisper-train[bnb]'"


def require_bitsandbytes(kind: str):
    """bitsandbytes, or a UserError naming the extra that installs it."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(
            f"--quantize-base {kind} needs bitsandbytes: {BNB_EXTRA}, or drop --quantize-base"
        )
    import bitsandbytes

    return bitsandbytes


def check_device(kind: str, device: torch.device) -> None:
    """Refuse a device bitsandbytes' layers do not run on, in one line."""
    if kind != "none" and torch.device(device).type not in SUPPORTED_DEVICES:
        raise UserError(
            f"--quantize-base {kind}: bitsandbytes does not run on {torch.device(device).type}; "
            f"train on {', '.join(SUPPORTED_DEVICES)}, or drop --quantize-base"
        )


def quantizable_linears(whisper: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of every plain linear layer inside the encoder's and the
    decoder's layers: the ones `quantize_base` replaces. Only shapes are read."""
    found: list[tuple[nn.Module, str, nn.Linear]] = []

    def search(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if type(child) is nn.Linear:  # not a bnb layer (a subclass)
                found.append((parent, name, child))
            elif not hasattr(child, "base_layer"):  # a peft adapter layer: its A and B train
                search(child)

    for stack in (whisper.model.encoder.layers, whisper.model.decoder.layers):
        search(stack)
    return found


def base_linears(whisper: nn.Module) -> list[nn.Linear]:
    """The frozen base's linear layers inside the encoder's and decoder's layers, whether plain,
    quantized already (bitsandbytes' layers are `nn.Linear`s) or inside peft's adapter layers
    (their `base_layer`): the layers --quantize-base holds in 8 or 4 bits. Only shapes are read,
    so `whisper` may live on the meta device (the planner's large models)."""
    return [
        module
        for stack in (whisper.model.encoder.layers, whisper.model.decoder.layers)
        for name, module in stack.named_modules()
        if isinstance(module, nn.Linear) and "lora_" not in name
    ]


def quantize_base(whisper: nn.Module, kind: str, *, compute_dtype: torch.dtype) -> int:
    """Replace the linear layers of `quantizable_linears` with bitsandbytes' (int8:
    `Linear8bitLt` without 16-bit weights; nf4: `Linear4bit`, double quantization, computing in
    `compute_dtype`), quantized from their loaded weights on the CPU; frozen. Returns how many
    were replaced. The model remembers `kind` (`quantized_as`)."""
    if kind not in QUANTIZE_BASE:
        raise UserError(f"--quantize-base {kind}: expected one of {', '.join(QUANTIZE_BASE)}")
    if kind == "none":
        return 0
    replaced = 0
    for parent, name, linear in quantizable_linears(whisper):
        setattr(parent, name, quantized_linear(linear, kind, compute_dtype=compute_dtype))
        replaced += 1
    # The full-precision weights just freed go back to the system, not into the allocator's
    # free heap, which a step's activations do not reuse (the multilingual base: 633 MB
    # resident before step 1 in nf4, 840 as loaded).
    return_freed_memory()
    whisper._whisper_train_quantized = kind
    return replaced


def quantized_linear(linear: nn.Linear, kind: str, *, compute_dtype: torch.dtype) -> nn.Module:
    """`linear` as bitsandbytes holds it in `kind` (int8 or nf4), on the CPU, frozen."""
    bnb = require_bitsandbytes(kind)
    weight = linear.weight.detach().to("cpu", torch.float32)
    has_bias = linear.bias is not None
    if kind == "int8":
        layer = int8_weights_linear_class()(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            has_fp16_weights=False,
            device="meta",
        )
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        layer = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            compute_dtype=compute_dtype,
            compress_statistics=True,
            quant_type="nf4",
            device="meta",
        )
        layer.weight = bnb.nn.Params4bit(
            weight,
            requires_grad=False,
            blocksize=NF4_BLOCK,
            compress_statistics=True,
            quant_type="nf4",
        )
        # On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight in place for its
        # inference kernel the first time the layer runs in eval mode, and never back: the
        # next training step then fails ("a view of a leaf Variable ... in-place"). Off, an
        # evaluation during training runs the same kernels as training does.
        layer.support_avx512bf16_for_cpu = False
    if has_bias:
        layer.bias = nn.Parameter(linear.bias.detach().to("cpu"), requires_grad=False)
    layer = layer.to("cpu")  # bitsandbytes quantizes as the weight moves to a device
    if kind == "int8":
        # The int8 rows and scales moved to the layer's state now, as bitsandbytes' first
        # forward would: whoever reads the state first (peft's DoRA dequantizes the weight
        # through it; `bnb.matmul` re-quantizes a state it finds empty) finds them there.
        layer.init_8bit_state()
    return layer.train(linear.training)


def _dequantized(int8_rows: torch.Tensor, row_scales: torch.Tensor, dtype) -> torch.Tensor:
    """bitsandbytes' int8 weight (one absmax-scaled row of int8 per output) as `dtype`."""
    return int8_rows.to(dtype).mul_(row_scales.unsqueeze(1).mul(1.0 / 127.0))


class _Int8WeightsProduct(torch.autograd.Function):
    """x @ W.T + b, W held as int8 rows and their scales and dequantized for the product,
    forward and backward alike. Nothing of x is kept: W is frozen, so x's gradient needs only
    W (the rows and scales are the layer's own, resident anyway); the bias's, where it
    trains, only the output's gradient."""

    @staticmethod
    def forward(ctx, x, int8_rows, row_scales, bias):
        ctx.int8_rows, ctx.row_scales = int8_rows, row_scales
        return nn.functional.linear(x, _dequantized(int8_rows, row_scales, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_output):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            weight = _dequantized(ctx.int8_rows, ctx.row_scales, grad_output.dtype)
            grad_x = grad_output @ weight
        if ctx.needs_input_grad[3]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_x, None, None, grad_bias


@functools.cache
def int8_weights_linear_class() -> type:
    """bitsandbytes' `Linear8bitLt` (its int8 parameters, its state, everything peft and
    bitsandbytes recognise it by) computing through `_Int8WeightsProduct`."""
    bnb = require_bitsandbytes("int8")

    class Int8WeightsLinear(bnb.nn.Linear8bitLt):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _Int8WeightsProduct.apply(x, self.state.CB, self.state.SCB, self.bias)

    return Int8WeightsLinear


def quantized_as(whisper: nn.Module) -> str:
    """none, int8 or nf4: how `quantize_base` left `whisper`."""
    return getattr(whisper, "_whisper_train_quantized", "none")


@contextlib.contextmanager
def peft_sees_quantized(whisper: nn.Module, kind: str) -> Iterator[None]:
    """While peft wraps adapters: the flags transformers sets on a model it quantized at load,
    by which peft chooses its bnb LoRA layers (and skips its input-grad hook, which only
    reentrant checkpointing needs). Removed afterwards: nothing else reads them."""
    flag = {"int8": "is_loaded_in_8bit", "nf4": "is_loaded_in_4bit"}.get(kind)
    if flag is None:
        yield
        return
    setattr(whisper, flag, True)
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            delattr(whisper, flag)


def quantized_bytes(in_features: int, out_features: int, kind: str) -> int:
    """Bytes one linear layer's weight takes held as `kind` (the bias, kept in 32 bits, apart).

    int8: a byte a weight and one float32 scale a row. nf4: half a byte a weight and, double
    quantized, one byte of absmax a block of 64 weights, one float32 scale per block of 256
    absmaxes and their float32 offset, and each layer's own codes (NF4's 16 values, the
    absmaxes' 256), in float32.
    """
    weights = in_features * out_features
    if kind == "none":
        return 4 * weights
    if kind == "int8":
        return weights + 4 * out_features
    blocks = -(-weights // NF4_BLOCK)
    absmax_blocks = -(-blocks // NF4_ABSMAX_BLOCK)
    return -(-weights // 2) + blocks + 4 * absmax_blocks + 4 + 4 * (16 + 256)


def quantized_module_bytes(module: nn.Module) -> int:
    """Bytes the weights of `module`'s bitsandbytes layers hold as stored: the packed
    weights, their scales and (nf4) the quantized absmaxes and their state. A check of
    `quantized_bytes` against what bitsandbytes really keeps."""
    total, seen = 0, set()
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        if id(weight) in seen:  # peft's adapter layer shows its base layer's weight too
            continue
        seen.add(id(weight))
        state = getattr(weight, "quant_state", None)
        if state is not None:  # Params4bit
            total += weight.data.numel() * weight.data.element_size()
            total += _tensor_bytes(state.absmax) + _tensor_bytes(state.code)
            nested = state.state2
            if nested is not None:
                total += _tensor_bytes(nested.absmax) + _tensor_bytes(nested.code)
                total += _tensor_bytes(state.offset)
        elif type(weight).__name__ == "Int8Params":  # its scales on the weight or the layer's state
            owner = getattr(layer, "base_layer", layer)  # peft's adapter layer, or the bnb one
            scales = weight.SCB if weight.SCB is not None else owner.state.SCB
            total += weight.data.numel() * weight.data.element_size() + _tensor_bytes(scales)
    return total


def weights_held(param: torch.Tensor) -> int:
    """How many weights `param` holds: a 4-bit one packs two in a byte (its numel is half)."""
    state = getattr(param, "quant_state", None)
    return state.shape.numel() if state is not None else param.numel()


def _tensor_bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


__all__ = [
    "BNB_EXTRA",
    "base_linears",
    "check_device",
    "peft_sees_quantized",
    "quantizable_linears",
    "quantize_base",
    "quantized_linear",
    "quantized_as",
    "quantized_bytes",
    "quantized_module_bytes",
    "require_bitsandbytes",
    "weights_held",
]
