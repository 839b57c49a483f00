"""Self-attention within spans: the encoder's self-attention of `--packing per-clip` on sdpa
(`clip_attention`'s SAMPLED_PAD context), where each clip and its own padding attend only
among themselves and each key's score is raised by log of the positions it stands for.

`clip_attention.count_bias` computes the same as one (W, 1, S, S) bias over whole windows,
which sdpa adds to every one of the S x S scores; here each span is its own sdpa call, so
neither the bias nor the scores between spans exist (a window of ~4 clips: a fifth of them).
Each encoder layer's attention module gets `forward_with_segments` as its forward (installed
by `clip_attention.route_clips`); given `EncoderSegments` for its mask it attends span by span,
given anything else it runs its class's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class EncoderSegments:
    """SAMPLED_PAD's encoder self-attention on sdpa, given to each encoder layer in place of
    its attention mask: each window's positions cut into the spans that attend only among
    themselves (a clip and its own padding; each run of positions in no clip, which the bias
    lets attend to every such position of the window: no clip's frame reads them either way),
    in order, covering the window, and the (W, S) positions each frame stands for
    (`clip_attention.block_context`)."""

    spans: tuple[tuple[tuple[int, int], ...], ...]  # per window: [start, end) in order
    counts: torch.Tensor  # (W, S) long


def cover_windows(
    spans: list[list[tuple[int, int]]], width: int
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each window's `spans` ([start, end), not overlapping) in order, with the positions of
    0..width in none of them as spans of their own: the window covered, in order."""
    covered_windows = []
    for spans_of_window in spans:
        cut, covered = [], 0
        for start, end in sorted(spans_of_window):
            if start > covered:
                cut.append((covered, start))
            cut.append((start, end))
            covered = end
        if covered < width:
            cut.append((covered, width))
        covered_windows.append(tuple(cut))
    return tuple(covered_windows)


def segmented_attention(
    attention: nn.Module, hidden: torch.Tensor, segments: EncoderSegments
) -> tuple[torch.Tensor, None]:
    """An encoder layer's self-attention (`attention`, Whisper's, its own projections) on the
    (W, S, d) `hidden`, each span of `segments` attending only to itself, each key's score
    raised by log of the positions it stands for: what the block-diagonal bias of `count_bias`
    computes, without the (W, S, S) bias or the scores between spans (a window of ~4 clips: a
    fifth of them). The same arithmetic as transformers' WhisperAttention with sdpa (the query
    scaled before the product, as there), span by span."""
    windows, width, _ = hidden.shape
    shape = (windows, width, attention.num_heads, attention.head_dim)
    query = (attention.q_proj(hidden) * attention.scaling).view(shape).transpose(1, 2)
    key = attention.k_proj(hidden).view(shape).transpose(1, 2)
    value = attention.v_proj(hidden).view(shape).transpose(1, 2)
    log_counts = segments.counts.to(query.dtype).log()  # in the scores' dtype (`count_bias`)
    dropout = attention.dropout if attention.training else 0.0
    by_window = []
    for window, spans in enumerate(segments.spans):
        rows = slice(window, window + 1)
        parts = [
            nn.functional.scaled_dot_product_attention(
                query[rows, :, start:end],
                key[rows, :, start:end],
                value[rows, :, start:end],
                attn_mask=log_counts[window, start:end][None, None, None, :],
                dropout_p=dropout,
                scale=1.0,
            )
            for start, end in spans
        ]
        by_window.append(torch.cat(parts, dim=2))  # the spans cover the window, in order
    output = torch.cat(by_window).transpose(1, 2).reshape(windows, width, -1)
    return attention.out_proj(output), None


def forward_with_segments(self: nn.Module, *args, **kwargs):
    """An encoder self-attention's forward, bound to the module (a deep copy rebinds it to the
    copy): given `EncoderSegments` for its mask, `segmented_attention`; else its class's own."""
    segments = kwargs.get("attention_mask")
    if not isinstance(segments, EncoderSegments):
        return type(self).forward(self, *args, **kwargs)
    hidden = args[0] if args else kwargs["hidden_states"]
    return segmented_attention(self, hidden, segments)
