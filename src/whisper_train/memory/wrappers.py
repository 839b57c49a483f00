"""Finding the Whisper model inside the wrappers training puts around it.

Three kinds of wrapper sit around a `WhisperForConditionalGeneration` during training: peft's
`PeftModel` (LoRA), DDP (`.module`) and torch.compile (`._orig_mod`). Checkpointing flags, the
output projection and the layer stacks live on the Whisper model itself, so every memory
decision starts here. This module imports no other part of the package, so any may use it.
"""

from __future__ import annotations

from accelerate.utils import DistributedDataParallelKwargs
from peft import PeftModel
from torch import nn

from whisper_train.errors import UserError


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` is a peft wrapper (`PeftModel`) around a base model."""
    return isinstance(model, PeftModel)


def whisper_or_none(model: nn.Module) -> nn.Module | None:
    """The `WhisperForConditionalGeneration` inside `model` (itself, or under a peft wrapper),
    or None where `model` is not a Whisper encoder-decoder (checks that merely report use it)."""
    base = model.get_base_model() if is_peft_model(model) else model
    return base if hasattr(base, "model") and hasattr(base.model, "encoder") else None


def whisper_of(model: nn.Module) -> nn.Module:
    """The `WhisperForConditionalGeneration` inside `model` (itself, or under a peft wrapper).

    Raises UserError for anything else. DDP and torch.compile wrappers are not looked through:
    strip them first with `unwrapped`.
    """
    whisper = whisper_or_none(model)
    if whisper is None:
        base = model.get_base_model() if is_peft_model(model) else model
        raise UserError(
            f"{type(base).__name__}: not a Whisper encoder-decoder; load the model with "
            "whisper_train.models.load_model"
        )
    return whisper


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers, any depth.

    A peft wrapper is kept: it is the model that trains (`whisper_of` looks inside it).
    """
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


__all__ = ["is_peft_model", "unwrapped", "whisper_of", "whisper_or_none"]


def ddp_settings(model) -> DistributedDataParallelKwargs:
    """DDP's settings for `model`. Non-reentrant checkpointing and no layerdrop: every parameter
    is used in every step, so DDP needs no unused-parameter search (which also breaks reentrant
    checkpointing, T3); layerdrop skips layers at random, leaving parameters unused (T4).
    static_graph stays off: it would add nothing with non-reentrant checkpointing, and DDP cannot
    combine it with `no_sync`, which gradient accumulation uses (the reducer's
    "expect_autograd_hooks_" assertion at the first backward, pytorch#143580)."""
    layerdrop = bool(model.config.encoder_layerdrop or model.config.decoder_layerdrop)
    return DistributedDataParallelKwargs(find_unused_parameters=layerdrop, static_graph=False)
