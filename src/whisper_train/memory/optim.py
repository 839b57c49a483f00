"""The optimiser: AdamW in one of three implementations, weight decay on matrices only, the
encoder at its own learning rate (`--encoder-lr-scale`).

`adamw` is torch's AdamW, with its fused kernel where the parameters allow it (else torch's
default); `adamw-fused` asks for the fused kernel and refuses to run without it.

The choice is a memory decision: AdamW keeps two float32 moments per trainable parameter
(8 bytes), bitsandbytes' AdamW8bit two uint8 moments (2 bytes); the planner
(`memory.estimate.estimate_memory`) counts the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from whisper_train.choices import OPTIMIZERS
from whisper_train.errors import UserError


def build_optimizer(
    parameters: nn.Module | Iterable[tuple[str, nn.Parameter]],
    *,
    name: str = "adamw",
    lr: float,
    weight_decay: float = 0.0,
    encoder_lr_scale: float = 1.0,
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, weight decay only on matrices, the encoder's at
    `encoder_lr_scale` times `lr`.

    `parameters` is a model or its `named_parameters()`. Biases and LayerNorm weights (every
    tensor with fewer than 2 dimensions) get no weight decay: shrinking a norm's gain or a bias
    towards zero is not regularisation, it changes the layer's output scale. With a scale of 1
    the encoder shares the other groups (two groups, as checkpoints of one rate hold).
    """
    named = list(parameters.named_parameters() if isinstance(parameters, nn.Module) else parameters)
    if encoder_lr_scale == 1:
        parts = [(named, lr)]
    else:
        parts = [
            ([(n, p) for n, p in named if not _in_encoder(n)], lr),
            ([(n, p) for n, p in named if _in_encoder(n)], lr * encoder_lr_scale),
        ]
    groups = []
    for part, part_lr in parts:
        decay, no_decay = _split_by_decay(iter(part))
        groups += [
            {"params": decay, "weight_decay": weight_decay, "lr": part_lr},
            {"params": no_decay, "weight_decay": 0.0, "lr": part_lr},
        ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise UserError("the model has no trainable parameters: check --mode and --lora-targets")
    if name == "adamw":
        if _fused_kernel_applies([p for g in groups for p in g["params"]]):
            # One kernel over each tensor instead of torch's per-tensor Python loop on a CPU:
            # 6.5-7x less optimizer time on tiny's and base's decoders, 8-10% of a cached
            # freeze-encoder step before (bench/freeze_encoder_profile.py); the same update to
            # a few ulps (tests/test_memory.py).
            try:
                return torch.optim.AdamW(groups, lr=lr, fused=True)
            except RuntimeError:  # a device or dtype without the kernel: torch's default
                pass
        return torch.optim.AdamW(groups, lr=lr)
    if name == "adamw-fused":
        try:
            return torch.optim.AdamW(groups, lr=lr, fused=True)
        except RuntimeError as exc:  # a device without a fused kernel
            raise UserError(
                f"--optim adamw-fused: {str(exc).splitlines()[0]}; use --optim adamw"
            ) from None
    if name == "adamw8bit":
        try:
            import bitsandbytes
        except ImportError:
            raise UserError(
                "--optim adamw8bit needs bitsandbytes: pip install 'whisper-train[bnb]', "
                "or use --optim adamw"
            ) from None
        return bitsandbytes.optim.AdamW8bit(groups, lr=lr)
    raise UserError(f"--optim {name}: expected one of {', '.join(OPTIMIZERS)}")


def _fused_kernel_applies(parameters: list[nn.Parameter]) -> bool:
    """Plain floating-point tensors on a CPU or CUDA device (`--fsdp`'s sharded DTensors keep
    torch's default implementation)."""
    return all(
        not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") and p.is_floating_point()
        for p in parameters
    )


def _in_encoder(name: str) -> bool:
    """A parameter of Whisper's encoder, wrapped or not (`model.encoder.…`, peft's
    `base_model.model.model.encoder.…`, DDP's `module.…`)."""
    return "encoder" in name.split(".")


def _split_by_decay(
    named: Iterator[tuple[str, nn.Parameter]],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, param in named:
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return decay, no_decay


__all__ = ["OPTIMIZERS", "build_optimizer"]
