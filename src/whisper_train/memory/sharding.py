"""`--fsdp`: each of N processes holds 1/N of the weights, gradients and optimiser state.

torch's FSDP2 (`fully_shard`) shards every encoder and decoder layer, each its own unit, and
the model itself (the root: convolutions, embeddings, the output projection tied to the token
embedding, the final norms). A unit's weights are gathered (all-gather) just before its forward
and freed after it, gathered again for its backward, and its gradients are reduce-scattered:
each process keeps the gradient and the Adam state of its own shard only.

Why not accelerate's `FullyShardedDataParallelPlugin(fsdp_version=2)`: accelerate turns FSDP on
only for GPU-like devices (its `AcceleratorState` ignores the plugin for CPU processes, which
stay data-parallel with DDP), so the plugin cannot run, nor be tested, on a CPU with gloo.
`fully_shard` runs on both (gloo on CPUs, NCCL on GPUs), and the recipe hands accelerate the
sharded model for mixed precision only (`Accelerator.prepare_model(..., evaluation_mode=True)`:
no DDP wrapper around it).

Three places need the whole weights at once, and get them here:
- the loss applies the output projection after the model's forward (`loss.loss_terms`): the
  root's weights, small beside the layers', stay gathered from its forward to the end of its
  backward (`reshard_after_forward=False` for the root);
- evaluation (`gathered`): `generate` runs a forward per token, as many as each process's
  clips need, so sharded layers would all-gather a different number of times on each process
  and wait for ever; gathered, a forward runs no collective at all;
- OUTPUT/final/ and checkpoints (`full_state_dict`, `sharded_state`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from whisper_train.memory.wrappers import whisper_of


def shard_model(model: nn.Module, device: torch.device) -> nn.Module:
    """Shard `model` (a Whisper model, or a peft model around one) over every process of the
    default process group, in place: each encoder and decoder layer, then the model itself.
    Returns `model`. Build the optimizer afterwards: sharding replaces the parameters."""
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    whisper = whisper_of(model)
    for layer in (*whisper.model.encoder.layers, *whisper.model.decoder.layers):
        fully_shard(layer, mesh=mesh)
    # The root is the outermost module (peft's wrapper for LoRA: its forward reaches Whisper's
    # by a plain method call, which would skip hooks on Whisper itself). Not resharded after
    # forward: the loss uses the tied output projection after it.
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` (or a module inside it) is sharded by `fully_shard`."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def gathered_weight(weight: torch.Tensor, owner: nn.Module) -> torch.Tensor:
    """`weight` as a whole tensor: where it is still a shard (a DTensor) outside its unit's
    forward, the FSDP unit in `owner` that holds it gathers it (every process must call this),
    and the gathered parameter is returned. It is freed again by that unit's next reshard
    (after its backward)."""
    if not isinstance(weight, DTensor):
        return weight
    units = [m for m in owner.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        named = dict(unit.named_parameters())
        if any(p is weight for p in named.values()):
            unit.unshard()
            name = next(n for n, p in named.items() if p is weight)
            return unit.get_parameter(name)
    raise ValueError("gathered_weight: no FSDP unit in `owner` holds this weight")


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Inside, every process holds all of `model`'s weights and a forward runs no collective;
    after, each unit is sharded again. Entering and leaving are collectives: every process
    enters and leaves together. Costs the whole model's weights on each process meanwhile
    (4 bytes a weight in fp32), not its gradients or optimiser state."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    root = units[0]
    for unit in units:  # the same order on every process: `modules()` order
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(unit is not root, recurse=False)
            unit.reshard()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict of a sharded `model`, on the CPU of the main process
    (rank 0); other processes get an empty dict. Every process must call this."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


__all__ = ["full_state_dict", "gathered", "gathered_weight", "is_sharded", "shard_model"]
