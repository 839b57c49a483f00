"""Cross-attention over cached encoder outputs, with its products in the cheaper order.

Each decoder layer's cross-attention projects the encoder's S = 1500 positions to keys and
values (2 S d^2 multiply-adds a clip) before T label tokens attend to them. When the encoder's
outputs are cached (`--mode freeze-encoder`), the projections still run every step, because
their weights train: they are half of a cached step (BENCHMARKS.md, "Freeze-encoder: what a
cached step spends"). The same attention with the weights moved to the query's side,
per head h, with E the encoder's outputs:

    scores_h = (q_h W_k,h) E^T             W_k has no bias
    output_h = (P_h E) W_v,h^T + b_v,h     each row of P_h sums to 1, so the bias passes through

costs 2 T d^2 + 2 H T S d instead of 2 S d^2 + 2 T S d: less while T < S d / (d + (H-1) S),
about 64-73 label tokens for every Whisper size. It is the same function (gradients
included), in another order of float operations: equal to rounding, which tests check in
float64. `folded_cross_attention` applies it for the duration of a forward, only where it is
cheaper and only where nothing else is asked of the layer (a cache, a mask, attention weights,
dropout, adapters on the key or value projection, a recomputation under checkpointing):
otherwise the layer's own forward runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection, Iterator

import torch
from torch import nn

# Keyword arguments of WhisperAttention.forward (transformers 4.56 and 5.x) that, when set, ask
# for something the folded order does not do.
_MUST_BE_UNSET = ("cache", "past_key_values", "past_key_value", "attention_mask", "layer_head_mask")


def folded_cost_is_lower(tokens: int, positions: int, d_model: int, heads: int) -> bool:
    """Whether the folded order multiplies less than projecting every encoder position."""
    folded = tokens * d_model * d_model + heads * tokens * positions * d_model
    projected = positions * d_model * d_model + tokens * positions * d_model
    return folded < projected


@contextlib.contextmanager
def folded_cross_attention(
    whisper: nn.Module, *, enabled: bool = True, recomputed: Collection[int] = ()
) -> Iterator[None]:
    """Inside, the decoder's cross-attention layers compute in the folded order where it is
    cheaper (see the module's docstring); `enabled` False changes nothing. Only the instances'
    forwards are shadowed: weights, state dict and wrappers are untouched.

    `recomputed`: the decoder layers checkpointing runs again in backward, after this context
    has closed; they keep their own order, so that the recomputation saves what the forward
    saved."""
    decoder_layers = whisper.model.decoder.layers if enabled else []
    layers = [
        layer.encoder_attn
        for index, layer in enumerate(decoder_layers)
        if index not in recomputed and _plain_projections(layer.encoder_attn)
    ]
    for attention in layers:
        attention.forward = functools.partial(_forward, attention, type(attention).forward)
    try:
        yield
    finally:
        for attention in layers:
            del attention.forward


def _plain_projections(attention: nn.Module) -> bool:
    """Keys and values from plain linear layers (no adapters), the key without bias, and plain
    tensors for weights (not `--fsdp`'s shards)."""
    key, value = attention.k_proj, attention.v_proj
    return (
        type(key) is nn.Linear
        and type(value) is nn.Linear
        and key.bias is None
        and type(key.weight.data) is torch.Tensor
        and type(value.weight.data) is torch.Tensor
    )


def _forward(attention, own_forward, hidden_states, key_value_states=None, *args, **kwargs):
    if not _foldable(attention, hidden_states, key_value_states, args, kwargs):
        return own_forward(attention, hidden_states, key_value_states, *args, **kwargs)
    return _folded(attention, hidden_states, key_value_states), None


def _foldable(attention, hidden_states, encoder_states, args, kwargs) -> bool:
    if encoder_states is None or args or kwargs.get("output_attentions"):
        return False
    if any(kwargs.get(name) is not None for name in _MUST_BE_UNSET):
        return False
    if attention.training and attention.dropout > 0:
        return False
    batch, tokens, d_model = hidden_states.shape
    if encoder_states.dim() != 3 or encoder_states.shape[0] != batch:
        return False
    return folded_cost_is_lower(tokens, encoder_states.shape[1], d_model, attention.num_heads)


def _folded(attention, hidden_states: torch.Tensor, encoder_states: torch.Tensor) -> torch.Tensor:
    batch, tokens, d_model = hidden_states.shape
    heads, head_dim = attention.num_heads, attention.head_dim
    # Scaled before the product, as Whisper's own forward does (its rounding order).
    query = attention.q_proj(hidden_states) * attention.scaling
    query = query.view(batch, tokens, heads, head_dim).transpose(1, 2)  # (B, H, T, dh)
    key_weight = attention.k_proj.weight.view(heads, head_dim, d_model)  # each head's rows
    value_weight = attention.v_proj.weight.view(heads, head_dim, d_model)
    encoder = encoder_states.to(query.dtype)  # (B, S, d)
    # Heads side by side along the tokens, so each product is one batched matmul over the clips
    # (a broadcast over heads would copy the encoder's outputs once per head).
    folded_query = (query @ key_weight).reshape(batch, heads * tokens, d_model)
    scores = folded_query @ encoder.transpose(1, 2)  # (B, H T, S)
    # In float32 at least, as Whisper's attention takes its softmax (16-bit scores included).
    at_least_float32 = torch.promote_types(scores.dtype, torch.float32)
    probabilities = torch.softmax(scores, dim=-1, dtype=at_least_float32).to(scores.dtype)
    mixed = (probabilities @ encoder).view(batch, heads, tokens, d_model)
    output = mixed @ value_weight.transpose(-1, -2)  # (B, H, T, dh)
    if attention.v_proj.bias is not None:
        output = output + attention.v_proj.bias.view(heads, 1, head_dim)
    output = output.transpose(1, 2).reshape(batch, tokens, d_model)
    return attention.out_proj(output)


__all__ = ["folded_cost_is_lower", "folded_cross_attention"]
