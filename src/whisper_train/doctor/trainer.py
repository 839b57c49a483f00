"""The model as a Hugging Face Trainer will train it: the checkpointing its arguments switch on,
put on a copy before the checks look at it."""

from __future__ import annotations

import json
from typing import Any

from torch import nn

from whisper_train.memory import (
    checkpointing_state,
    whisper_or_none,
)

# -- the model as it will train ---------------------------------------------------------


def as_trainer_will_run(model: nn.Module, trainer_args: Any) -> tuple[nn.Module, bool]:
    """`model` (modified in place) with the checkpointing a Hugging Face Trainer would switch
    on; and whether checkpointing was already on by hand before that."""
    hand_enabled = _is_hand_enabled(model)
    flag, kwargs = trainer_checkpointing(trainer_args)
    if flag:
        _enable_like_trainer(model, kwargs)
    return model, hand_enabled


def trainer_checkpointing(trainer_args: Any) -> tuple[bool, dict | None]:
    """(flag, kwargs) from Seq2SeqTrainingArguments (5.x names first, then 4.x names)."""
    if trainer_args is None:
        return False, None
    flag = getattr(trainer_args, "activation_checkpointing", None)
    if flag is None:
        flag = getattr(trainer_args, "gradient_checkpointing", False)
    kwargs = getattr(trainer_args, "activation_checkpointing_kwargs", None)
    if kwargs is None:
        kwargs = getattr(trainer_args, "gradient_checkpointing_kwargs", None)
    if isinstance(kwargs, str):  # the Trainer accepts a JSON string from the command line
        kwargs = json.loads(kwargs)
    return bool(flag), kwargs


def _enable_like_trainer(model: nn.Module, kwargs: dict | None) -> None:
    """What `Trainer.train()` does with gradient_checkpointing=True, on this transformers."""
    if hasattr(model, "activation_checkpointing_enable"):  # 5.x: {} and None both mean default
        kwargs = dict(kwargs or {})
        every = kwargs.pop("every_n_layers", 1)
        offload = kwargs.pop("offload", False)
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs or None, every_n_layers=every, offload=offload
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _is_hand_enabled(model: nn.Module) -> bool:
    """Checkpointing is on but was not set by prepare_model (which marks the model)."""
    whisper = whisper_or_none(model)
    marked = whisper is not None and getattr(whisper, "_whisper_train_checkpointing", None)
    return checkpointing_state(model)["enabled"] and not marked
