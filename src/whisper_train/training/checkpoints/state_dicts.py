"""What of the model and the optimizer a checkpoint holds: the trainable weights' size, and
under --fsdp the options that save and read their shards (torch.distributed.checkpoint)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from whisper_train.memory import is_sharded

# Adam keeps two float32 moments per trainable weight, beside the weight itself.
_ADAM_COPIES = 3


# -- size ---------------------------------------------------------------------------------


def estimate_checkpoint_bytes(model: torch.nn.Module) -> int:
    """Bytes of one checkpoint: trainable weights and Adam's two moments, in float32."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return _ADAM_COPIES * 4 * trainable + (1 << 20)  # + RNG, scheduler, state: well under 1 MiB


# -- sharded weights (--fsdp) -------------------------------------------------------------


def sharded(model) -> bool:
    """Whether `model`'s weights are sharded over the processes (--fsdp): saved as sharded/."""
    return is_sharded(model)


def shard_options(*, loading: bool = False) -> StateDictOptions:
    # The trainable weights only, as trainable.safetensors holds: the frozen rest (LoRA's base)
    # is read from --model again. Loading, the frozen ones are absent by design (not strict);
    # a trainable one missing from the checkpoint fails in `dcp.load` already.
    return StateDictOptions(ignore_frozen_params=True, strict=not loading)


def torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # inside accelerate's wrapper
