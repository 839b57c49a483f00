"""The probe: saved activations measured on the real model, to calibrate the estimate's count.

`probe_saved_bytes` counts what one training forward pass keeps for backward (saved-tensor
hooks, unique storages, parameters excluded, and the inputs checkpointed layers keep);
`calibrate` divides that by estimate.py's count of the same quantity for one random sample:
the correction `plan_checkpointing` applies to the count before choosing a policy.
"""

from __future__ import annotations

import torch
from torch import nn

from whisper_train.memory.checkpointing import checkpointing_policy
from whisper_train.memory.estimate import count_saved_bytes
from whisper_train.memory.loss import training_loss
from whisper_train.memory.wrappers import whisper_of


def probe_saved_bytes(
    model: nn.Module,
    input_features: torch.Tensor,
    decoder_input_ids: torch.Tensor,
    *,
    autocast_dtype: torch.dtype | None = None,
) -> int:
    """Measure the bytes kept for backward by one training forward pass of `model`.

    Counts each storage once (views share one), leaves parameters out, and for checkpointed
    layers counts the inputs their recompute keeps alive (inside a non-reentrant checkpoint
    autograd saves nothing, so the saved-tensor hooks alone would miss them).
    input_features: (batch, n_mels, 3000); decoder_input_ids: (batch, T).
    """
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def remember(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer and pointer not in parameter_storages:
            kept.setdefault(pointer, storage.nbytes())

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        remember(tensor)
        return tensor

    def before_layer(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if getattr(module, "gradient_checkpointing", False) and module.training:
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor):
                    remember(value)

    whisper = whisper_of(model)
    layers = [*whisper.model.encoder.layers, *whisper.model.decoder.layers]
    handles = [layer.register_forward_pre_hook(before_layer, with_kwargs=True) for layer in layers]
    batch = {
        "input_features": input_features,
        "decoder_input_ids": decoder_input_ids,
        "labels": decoder_input_ids.clone(),
    }
    was_training = model.training
    model.train()
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
            torch.autocast(
                input_features.device.type,
                dtype=autocast_dtype or torch.float32,
                enabled=autocast_dtype is not None,
            ),
        ):
            loss = training_loss(model, batch)  # the loss training computes
        del loss  # the graph (and everything it saved) is freed without a backward pass
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return sum(kept.values())


def calibrate(model: nn.Module, *, label_tokens: int = 32, policy: str = "off") -> float:
    """measured / counted saved bytes for one random sample under `policy` (default off).

    One forward pass at batch 1 (full 3000-frame input), no backward, on the model's device.
    1.0 for the layers this module counts; a model with other layers moves it. "off" sees
    every layer's internals; "full" needs far less memory but only sees the layers' inputs.
    """
    whisper = whisper_of(model)
    device = next(model.parameters()).device
    features = torch.randn(
        1, whisper.config.num_mel_bins, 2 * whisper.config.max_source_positions, device=device
    )
    tokens = torch.full((1, label_tokens), whisper.config.decoder_start_token_id, device=device)
    with checkpointing_policy(model, policy):
        measured = probe_saved_bytes(model, features, tokens)
    counted = count_saved_bytes(model, policy=policy, label_tokens=label_tokens)["device"]
    return measured / counted
