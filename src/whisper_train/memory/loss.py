"""The training loss without the full-vocabulary logits.

Whisper's own loss computes logits for every decoder position (batch x T x 51,866) and keeps
their log-softmax until backward: the largest tensor a decoder step holds. `training_loss`
computes the same mean cross-entropy from logits at label positions only, `LOSS_CHUNK_TOKENS`
at a time, and recomputes each chunk in backward when checkpointing is on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from whisper_train.collate import IGNORE_INDEX
from whisper_train.memory.checkpointing import checkpointing_on
from whisper_train.memory.wrappers import unwrapped, whisper_of

# Label tokens whose logits exist at once. 51,866 logits a token: 256 tokens are 53 MB in fp32,
# where a batch of 16 x 448-token labels would be 1.5 GB, kept until backward. Read at call
# time, so a test can patch it here (`whisper_train.memory.loss.LOSS_CHUNK_TOKENS`).
LOSS_CHUNK_TOKENS = 256


def training_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Teacher-forced cross-entropy, the mean over label tokens, without full-vocabulary logits.

    `batch` holds `decoder_input_ids` (batch, T), `labels` (batch, T; -100 where there is no
    loss) and either `input_features` (batch, n_mels, frames) or `encoder_hidden_states`
    (batch, positions, d_model: cached encoder outputs). The model's own forward runs (through
    any DDP, compile or peft wrapper, so gradients synchronise) with its output projection left
    out; the logits are then computed only where a label is, not for the prompt prefix or
    padding, `LOSS_CHUNK_TOKENS` at a time. With checkpointing on, each chunk's logits are
    recomputed in backward instead of kept: the log-softmax of every label token is the largest
    tensor a decoder keeps otherwise. Returns a scalar.
    """
    whisper = whisper_of(unwrapped(model))
    inputs = {"decoder_input_ids": batch["decoder_input_ids"]}
    if "encoder_hidden_states" in batch:
        from transformers.modeling_outputs import BaseModelOutput

        hidden = batch["encoder_hidden_states"].to(whisper.proj_out.weight.dtype)
        inputs["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
    else:
        inputs["input_features"] = batch["input_features"]
    if type(whisper.proj_out) is not nn.Linear:
        # Adapters on the output head (peft wraps it): only the model knows its logits.
        return model(**inputs, labels=batch["labels"]).loss
    with _projection_deferred(whisper):
        decoder_states = model(**inputs).logits  # (batch, T, d_model): hidden states here
    labels = batch["labels"].to(decoder_states.device)
    keep = labels != IGNORE_INDEX
    states, targets = decoder_states[keep], labels[keep]  # (n, d_model), (n,)
    if len(targets) == 0:  # nothing to learn; a zero that still reaches every parameter
        return decoder_states.sum() * 0.0
    recompute = torch.is_grad_enabled() and checkpointing_on(whisper)
    weight = whisper.proj_out.weight
    # Summed in float32 at least (16-bit logits under autocast); a float64 model stays float64.
    total = states.new_zeros((), dtype=torch.promote_types(states.dtype, torch.float32))
    for start in range(0, len(targets), LOSS_CHUNK_TOKENS):
        chunk = slice(start, start + LOSS_CHUNK_TOKENS)
        if recompute:
            total = total + torch.utils.checkpoint.checkpoint(
                _summed_cross_entropy, states[chunk], weight, targets[chunk], use_reentrant=False
            )
        else:
            total = total + _summed_cross_entropy(states[chunk], weight, targets[chunk])
    return total / len(targets)


def _summed_cross_entropy(
    states: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Summed cross-entropy of (n, d_model) states against (n,) targets through (vocab, d_model)
    `weight`; the (n, vocab) logits exist only inside this call."""
    logits = torch.nn.functional.linear(states, weight)  # half precision under autocast
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")


@contextlib.contextmanager
def _projection_deferred(whisper: nn.Module) -> Iterator[None]:
    """Inside, the model's `logits` output is the decoder's hidden states: the output projection
    (`proj_out`, tied to the token embedding) passes its input through. Only this instance's
    forward is shadowed: weights, state dict and tying are untouched."""
    projection = whisper.proj_out
    projection.forward = _pass_through
    try:
        yield
    finally:
        del projection.forward


def _pass_through(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


__all__ = ["LOSS_CHUNK_TOKENS", "training_loss"]
