"""Packed windows with one decoder pass per clip (`--packing per-clip`).

The encoder runs once on a 30 s window holding several clips; each clip then has its own decoder
pass, which learns that clip's own label (its own prefix, its own <|endoftext|>) and
cross-attends only to that clip's encoder positions: what unpacked training teaches, at the
encoder cost of packing. A packed micro-batch holds W windows and C >= W clips:

    input_features     (W, n_mels, frames)   the windows
    decoder_input_ids  (C, T), labels (C, T) each clip's own label
    clip_windows       (C,)                  the window each clip is in
    clip_positions     (C, 2)                its encoder positions [start, end) in that window

The model's own forward runs (through DDP, FSDP and peft, so gradients synchronise as for any
batch), given the windows' features and the clips' decoder inputs; two hooks, installed once
per model (`route_clips`), join the two batch sizes:

- on the encoder: its output for the W windows, (W, S, d), becomes each clip's own positions,
  (C, L, d), L the longest clip's (the shorter ones padded);
- on each decoder layer's cross-attention: a key mask that hides that padding.

The encoder hook acts once, on the next encoder forward after `ClipRouter.arm`: the one inside
the model call `loss_terms` makes. The mask hook acts only where the keys are that very gathered
tensor (the same memory, `same_tensor`): a decoder layer recomputed under checkpointing, in
backward after the forward has returned, is given that tensor again and so gets the same mask;
any other forward
(generation, evaluation, a micro-batch of single clips) meets other tensors and runs as if no
hook were there.

The encoder's context: each clip is encoded as if it were alone in a window padded with silence,
which is what unpacked training and every runtime show the model. The contexts below approach
that one after another, as measured; the default, for every mode, is the last and closest,
"block-restart-ownpad-sampled" (`packing.DEFAULT_PER_CLIP_CONTEXT`; before it, "block-restart-pad"
with LoRA and "block-restart-silence-detached" in full and freeze-encoder fine-tuning). In
"block-restart-pad" each encoder layer's self-attention gets
a block-diagonal mask: a clip's positions attend to their own and to the window's tail (the padding
after its last clip, which attends only to itself and is shared by the window's clips), never to a
neighbour's; each clip's positions are embedded as 0..n-1, where that clip alone would have them;
and its decoder pass cross-attends to its own positions and the tail's. (The convolutions before
the layers still see one frame of the gap at each edge of a clip.) Three more hooks do this, idle
unless a route is armed: an encoder pre-hook builds the mask and positions, the encoder's position
embedding returns the restarted ones, and each encoder layer's pre-hook hands it the mask as its
`attention_mask` argument. A checkpointed layer's recomputation in backward must get that mask
again, after the forward has ended: transformers 5.24 checkpoints a layer's `forward` inside its
hooks (the recomputation keeps the argument the hook gave), but 4.56 to 5.17 at least checkpoint
the call, hooks included (the recomputation runs the hook again, on its input's memory as a new
tensor object): the hook remembers which input it gave which mask (`same_tensor`). (Found on a GPU,
where a layer recomputed without its mask picks another attention kernel and backward fails: "A
different number of tensors was saved"; on a CPU the same, or with eager attention, wrong gradients
in silence.) The other contexts stay for the measurement (`ENCODER_CONTEXT`, an environment
variable bench/quality.py sets; not an option): "window" (the encoder on the window as it is,
neighbours visible: the first per-clip packing, 12-13 points worse held-out), "block"
(block-diagonal only), "block-restart" (no tail) and "block-restart-ownpad" (each clip with padding
of its own, not shared: the silence after it up to the next clip, or to the window's end after the
last one, in its block and embedded after it, 0..n+p-1; its windows are planned with a longer gap,
OWNPAD_GAP_SECONDS, so that each clip has some; measured no better than "block-restart-pad" at the
same gap, BENCHMARKS.md "Each clip with padding of its own"), "block-restart-silence" and
"block-restart-silence-self" (a window of silence encoded beside each window stands for the padding
a clip alone has: each clip's decoder pass cross-attends to its own frames and the silence window's
n..1499; with -self its frames also attend to those in every encoder layer, through the
self-attention's keys. Closer to unpacked per clip seen, at 2x and 2.7x the step, BENCHMARKS.md
"The padding's encoder outputs in sight"; block-restart-pad taught a decoder whose weights all
train to stop early on real speech, "Per-clip on real speech", and the silence window kept it), and
"block-restart-silence-detached" (the default in full fine-tuning before SAMPLED_PAD):
block-restart-silence's forward, its silence windows encoded in a forward of their own without
gradient (the encoder pre-hook calls the encoder's `forward`, so these hooks stay out of it): as
good per clip seen on the demo's sets and on real speech, at 0.72-0.84x its step (BENCHMARKS.md "A
silence window without gradient"). The in-batch silence windows double the encoder's batch:
`encoder_rows_per_window`, which the memory planner counts; the detached ones keep nothing for
backward.

None of these is a clip alone: alone, its n frames attend to 1500 - n frames of padding in every
layer, those attend to the clip (their states differ from pure silence's by 25-80% in every layer
of tiny.en, as far as 8 s after the clip), and its decoder cross-attends to all 1500. A step's
gradient in the contexts above points 0.73-0.91 (cosine) the way unpacked training's does on the
same clips (bench/per_clip_fidelity.py). "block-restart-ownpad-sampled" (SAMPLED_PAD) is a clip
alone, sampled: its window lays each clip's own padding after it (`packing.own_padding_seconds`),
one frame for every SAMPLED_PAD_STRIDE positions of the 1500 - n it has alone; each such frame
stands for its share of those positions (`block_context`'s counts: S - n spread evenly from n on),
is embedded at their mean position embedding (the sinusoids that vary faster than the samples
average out, `mean_embeddings`) and, as a key, gets log(count) added to its score, in the encoder's
self-attention and the decoder's cross-attention (`count_bias`): softmax over one key with log(c)
added is softmax over c copies of it, and c copies of a frame, given the same input and keys, stay
copies through every layer. So at a stride of 1 it is unpacked training exactly, and at 8 a step's
gradient is within 0.94-0.95 of unpacked's direction (the float64 tests prove the copies; the
bench measures the stride) at about 4 clips a window of the demo's ~3 s clips, with no silence
forward. On sdpa its encoder self-attention runs span by span (`span_attention`: each encoder
layer's attention module is given the spans for its mask),
the block-diagonal bias never built: the same arithmetic, about a fifth of the scores.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from whisper_train.data.packing import OWNPAD, PER_CLIP_ENCODER, SAMPLED_PAD, per_clip_context
from whisper_train.memory.span_attention import (
    EncoderSegments,
    cover_windows,
    forward_with_segments,
)

# The attribute of a Whisper model that holds its router once `route_clips` installed it.
_ROUTER = "_whisper_train_clip_router"
# The environment variable that picks another encoder context for --packing per-clip than the
# default (internal, for bench/quality.py's comparison).
ENCODER_CONTEXT = PER_CLIP_ENCODER
# "block-restart-silence" (SILENCE): each clip's decoder pass cross-attends to all S positions,
# as at inference: its own frames at 0..n-1, then positions n..S-1 of a window of pure silence
# (the clip's window's log-mel floor) encoded beside it, which stands for the padding a clip
# alone has. The encoder's batch doubles (a silence window per window).
SILENCE = "block-restart-silence"
# "block-restart-silence-self" (SILENCE_SELF): as SILENCE, and in every encoder layer a clip's
# frames also attend to the silence window's frames at n..S-1, as a clip alone attends to its
# padding (which, unlike a clip's own padding, does not attend back to the clip).
SILENCE_SELF = "block-restart-silence-self"
# "block-restart-silence-detached" (SILENCE_DETACHED): SILENCE's forward, but the silence
# windows are encoded in a forward of their own without gradient: a window's silence costs
# one forward, not a forward, a backward (and under checkpointing a recomputation), 0.72-0.84x
# SILENCE's step as measured; the encoder learns only from the clips' own frames (the
# decoder's weights, from every key).
SILENCE_DETACHED = "block-restart-silence-detached"
# The contexts whose clips' keys end with a silence window's outputs, and those whose silence
# windows go through the encoder in the windows' own batch (and its backward).
SILENCE_CONTEXTS = (SILENCE, SILENCE_SELF, SILENCE_DETACHED)
SILENCE_IN_BATCH = (SILENCE, SILENCE_SELF)
ENCODER_CONTEXTS = (
    "window",
    "block",
    "block-restart",
    "block-restart-pad",
    OWNPAD,
    SILENCE,
    SILENCE_SELF,
    SILENCE_DETACHED,
    SAMPLED_PAD,
)
# The context `--packing per-clip` uses is SAMPLED_PAD unless $WHISPER_TRAIN_PER_CLIP_ENCODER names
# another (`packing.per_clip_context`: the data's layout depends on it too). The two it replaced:
# with LoRA, block-restart-pad; with every weight of the decoder training, block-restart-pad
# taught the model to stop early on real speech (LJ Speech 17.7% against 7.3-7.8 unpacked, 11.8%
# deletions, AN4 x 8 epochs), which the silence window kept (SILENCE_DETACHED, 7.5).
# "block-restart-ownpad" (OWNPAD): each clip's own padding is the silence after it in its
# window, up to the next clip (after the window's last clip: up to the window's end); its
# windows are planned with a longer gap (`packing.per_clip_gap_seconds`) so that each has some.


@dataclass
class ClipRoute:
    """Where each clip of a packed micro-batch is: its window and encoder positions."""

    windows: torch.Tensor  # (C,) long
    starts: torch.Tensor  # (C,) long, encoder positions
    ends: torch.Tensor  # (C,) long, exclusive
    context: str = "window"  # the encoder's: one of ENCODER_CONTEXTS


class ClipRouter:
    """The two hooks' shared state: the route armed for the next encoder forward, and the
    gathered keys and mask of the last one it made."""

    def __init__(self, whisper: nn.Module):
        self.pending: ClipRoute | None = None
        self.keys: weakref.ref | None = None  # the gathered encoder outputs, (C, L, d)
        self.mask: torch.Tensor | None = None  # (C, 1, 1, L): True where a key is the clip's
        self.key_counts: torch.Tensor | None = None  # SAMPLED_PAD: (C, L), `gathered_counts`
        self.eager = getattr(whisper.config, "_attn_implementation", "sdpa") == "eager"
        # During an armed encoder forward with a block context: the (W, 1, S, S) self-attention
        # mask (True: may attend) and the (W, S) positions to embed (None: the window's own).
        self.encoder_mask: torch.Tensor | None = None
        self.encoder_positions: torch.Tensor | None = None
        # SAMPLED_PAD: the (W, S) encoder positions each frame stands for, from its position on
        # (1 but for a clip's own padding's samples)
        self.encoder_counts: torch.Tensor | None = None
        # (an encoder layer's input, the mask the layer was given) in the last routed encoder
        # forward, for its recomputation where transformers runs the hook again (module doc)
        self.given_masks: list[tuple[weakref.ref, torch.Tensor]] = []
        # SILENCE_DETACHED: the (W, S, d) silence windows' outputs, from the encoder pre-hook
        # to the encoder hook of the same forward
        self.silence_outputs: torch.Tensor | None = None

    def arm(self, route: ClipRoute | None) -> None:
        """The next encoder forward gathers `route`'s clips (None: it runs as it is)."""
        self.pending = route
        self.encoder_mask = self.encoder_positions = self.encoder_counts = None

    def encoder_pre_hook(self, module, args, kwargs):
        route = self.pending
        if route is None or route.context == "window":
            return None
        self.given_masks = []  # the last micro-batch's backward is done: a new one begins
        features = args[0] if args else kwargs["input_features"]
        if route.context == SILENCE_DETACHED:
            # The encoder's own forward (not its call: these hooks stay out), nothing armed,
            # so its layers and positions run as they are; no graph kept.
            with torch.no_grad():
                self.silence_outputs = module.forward(silence_windows(features))[0]
        if route.context in SILENCE_IN_BATCH:
            features = with_silence_windows(features)
            if args:
                args = (features, *args[1:])
            else:
                kwargs = {**kwargs, "input_features": features}
        blocks, positions, counts = block_context(route, len(features), module.embed_positions)
        if route.context == SAMPLED_PAD and not self.eager:  # no (W, S, S) mask: span by span
            mask = EncoderSegments(block_segments(route, len(features), blocks.shape[-1]), counts)
        else:
            mask = block_mask(blocks, route.context)
        self.encoder_mask, self.encoder_counts = mask, counts
        if route.context == SILENCE_SELF:
            mask = torch.cat([mask, silence_keys_mask(route, mask)], dim=-1)
            self.encoder_mask = mask
        restart = route.context.startswith("block-restart")
        self.encoder_positions = positions if restart else None
        return (args, kwargs) if route.context in SILENCE_IN_BATCH else None

    @staticmethod
    def self_attention_hook(module, args, kwargs):
        """SILENCE_SELF: a mask over twice the sequence's keys is the sign (kept by a
        checkpointed layer's recomputation) to give each window's queries its silence
        window's frames after its own, and each silence window's itself twice (the second
        copy masked)."""
        hidden = args[0] if args else kwargs["hidden_states"]
        mask = kwargs.get("attention_mask")
        if not isinstance(mask, torch.Tensor) or mask.shape[-1] != 2 * hidden.shape[1]:
            return None
        silence = hidden[len(hidden) // 2 :]
        return args, {**kwargs, "key_value_states": torch.cat([hidden, silence.repeat(2, 1, 1)], 1)}

    def positions_hook(self, module, args, output):
        if self.encoder_positions is None:
            return None
        embedded = nn.functional.embedding(self.encoder_positions, module.weight)  # (W, S, d)
        if self.encoder_counts is not None:  # a sample of padding: the mean of those it stands for
            embedded = torch.where(
                (self.encoder_counts > 1)[..., None],
                mean_embeddings(module.weight, self.encoder_positions, self.encoder_counts),
                embedded,
            )
        return embedded

    def encoder_layer_hook(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if self.encoder_mask is None:  # outside a routed forward: a recomputation of one?
            given = (
                mask for layer_input, mask in self.given_masks if same_tensor(hidden, layer_input())
            )
            mask = next(given, None)
            if mask is None:
                return None
        else:
            mask = self.encoder_mask
            if isinstance(mask, EncoderSegments):  # SAMPLED_PAD on sdpa: `segmented_attention`
                pass
            elif self.encoder_counts is not None and mask.dtype == torch.bool:  # SAMPLED_PAD
                counts = self.encoder_counts[:, None, None, :]
                self.encoder_mask = mask = count_bias(mask, counts, hidden)  # once a forward
            elif self.eager and mask.dtype == torch.bool:  # eager adds its mask to the scores
                blocked = torch.finfo(hidden.dtype).min
                zeros = torch.zeros(mask.shape, dtype=hidden.dtype, device=mask.device)
                self.encoder_mask = mask = zeros.masked_fill(~mask, blocked)  # once a forward
            self.given_masks.append((weakref.ref(hidden), mask))
        kwargs = {key: value for key, value in kwargs.items() if key != "attention_mask"}
        return (hidden, mask, *args[2:]), kwargs

    def encoder_hook(self, module, args, kwargs, output):
        route, self.pending = self.pending, None
        counts, self.encoder_counts = self.encoder_counts, None
        self.encoder_mask = self.encoder_positions = None
        if route is None:
            return output
        encoded, silence, self.silence_outputs = output[0], self.silence_outputs, None
        if silence is not None:  # SILENCE_DETACHED: the windows, then their silence windows
            encoded = torch.cat([encoded, silence.to(encoded.dtype)])
        keys, mask = gather_clip_positions(encoded, route)
        self.keys, self.mask = weakref.ref(keys), mask
        self.key_counts = None if counts is None else gathered_counts(counts, route, keys.shape[1])
        output["last_hidden_state"] = keys
        return output

    def cross_attention_hook(self, module, args, kwargs):
        keys = kwargs.get("key_value_states")
        if keys is None or self.keys is None or not same_tensor(keys, self.keys()):
            return None
        mask = self.mask
        if self.key_counts is not None:  # SAMPLED_PAD: a bias
            mask = count_bias(mask, self.key_counts[:, None, None, :], keys)
        elif self.eager:  # eager attention adds its mask to the scores
            blocked = torch.finfo(torch.float32).min
            mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, blocked)
        return args, {**kwargs, "attention_mask": mask}


def block_segments(
    route: ClipRoute, windows: int, width: int
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each window's [start, end) spans in order, covering 0..width (`cover_windows`): each clip
    with its own padding (`own_pad_ends`), and the positions before or between them in no clip."""
    ends = own_pad_ends(route, width)
    blocks: list[list[tuple[int, int]]] = [[] for _ in range(windows)]
    spans = zip(route.windows.tolist(), route.starts.tolist(), ends.tolist(), strict=True)
    for window, start, end in spans:
        blocks[window].append((start, end))
    return cover_windows(blocks, width)


def count_bias(mask: torch.Tensor, counts: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """SAMPLED_PAD's attention mask: a bias added to the scores, log of the positions each key
    stands for (`counts`, broadcast against the boolean `mask`: softmax over a key once with
    log(c) added to its score is softmax over c copies of it), the dtype's minimum where `mask`
    is False. Built in the dtype the scores will have (`hidden`'s, or autocast's where it is
    on): torch's sdpa on a CPU given a float32 bias beside float64 queries computes other scores
    (a layer's output 5e-3 off, measured on torch 2.13)."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    bias = counts.to(dtype).log().expand(mask.shape)
    return bias.masked_fill(~mask, torch.finfo(dtype).min)


def same_tensor(tensor: torch.Tensor, other: torch.Tensor | None) -> bool:
    """Whether `tensor` is `other` or the same memory seen the same way: a recomputation under
    non-reentrant checkpointing gets the forward's tensor arguments back as new tensor objects
    over the same storage (a layer's hooks see those where they run inside the checkpoint)."""
    return other is not None and (
        tensor is other
        or (
            tensor.data_ptr() == other.data_ptr()
            and tensor.shape == other.shape
            and tensor.stride() == other.stride()
            and tensor.dtype == other.dtype
        )
    )


def gather_clip_positions(
    encoded: torch.Tensor, route: ClipRoute
) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, L, d) encoder outputs of each clip (its window's positions [start, end), padded
    with copies of its last one up to L, the longest clip's length) and the (C, 1, 1, L) mask
    that is True on each clip's own positions. With the "-pad" context, each clip's window's
    tail [its last clip's end, S) follows, padded the same way to the longest tail. With
    "-ownpad" and SAMPLED_PAD, each clip's own padding follows its frames."""
    device = encoded.device
    starts, ends = route.starts.to(device), route.ends.to(device)
    if route.context in SILENCE_CONTEXTS:  # the clip's own frames, then silence's n..S-1
        windows, width = route.windows.to(device)[:, None], encoded.shape[1]
        offsets = torch.arange(width, device=device)[None, :]
        own = offsets < (ends - starts)[:, None]
        rows = torch.where(own, windows, windows + encoded.shape[0] // 2)
        keys = encoded[rows, torch.where(own, starts[:, None] + offsets, offsets)]
        return keys, torch.ones(keys.shape[:2], dtype=torch.bool, device=device)[:, None, None]
    if route.context in (OWNPAD, SAMPLED_PAD):  # the clip and its own padding, one span
        ends = own_pad_ends(route, encoded.shape[1]).to(device)
    if route.context.endswith("-pad"):
        tails = tail_starts(route).to(device)
        spans = [(starts, ends), (tails, torch.full_like(tails, encoded.shape[1]))]
    else:
        spans = [(starts, ends)]
    windows = route.windows.to(device)[:, None]
    keys, valid = [], []
    for first, end in spans:
        lengths = end - first
        offsets = torch.arange(int(lengths.max()), device=device)
        valid.append(offsets[None, :] < lengths[:, None])  # (C, L)
        last = torch.clamp(lengths[:, None] - 1, min=0)  # an empty tail: any position, masked
        keys.append(encoded[windows, first[:, None] + torch.minimum(offsets[None, :], last)])
    return torch.cat(keys, dim=1), torch.cat(valid, dim=1)[:, None, None, :]


def gathered_counts(counts: torch.Tensor, route: ClipRoute, width: int) -> torch.Tensor:
    """(C, width): the positions each of a clip's gathered keys stands for (SAMPLED_PAD; the
    (W, S) `counts` of `block_context`), in `gather_clip_positions`'s order: the clip's frames
    and its own padding's samples, then copies of the last (masked)."""
    device = counts.device
    starts = route.starts.to(device)
    ends = own_pad_ends(route, counts.shape[1]).to(device)
    offsets = torch.arange(width, device=device)[None, :]
    last = torch.clamp(ends - starts - 1, min=0)[:, None]
    return counts[route.windows.to(device)[:, None], starts[:, None] + torch.minimum(offsets, last)]


def silence_windows(features: torch.Tensor) -> torch.Tensor:
    """(W, n_mels, frames): for each of the W windows a window of silence: every bin at that
    window's lowest value, the log-mel floor its clamp gives silence (and padding)."""
    return features.amin(dim=(1, 2), keepdim=True).expand_as(features)


def with_silence_windows(features: torch.Tensor) -> torch.Tensor:
    """(2W, n_mels, frames): the W windows, then their silence windows (`silence_windows`)."""
    return torch.cat([features, silence_windows(features)])


def silence_keys_mask(route: ClipRoute, window_mask: torch.Tensor) -> torch.Tensor:
    """(2W, 1, S, S), to go beside `window_mask` (each window's own keys): which frames of its
    silence window each query may also attend to (SILENCE_SELF). A clip of n frames: those at
    n..S-1, its padding were it alone; a frame in no clip, and a silence window's, none."""
    rows, width, device = window_mask.shape[0], window_mask.shape[-1], window_mask.device
    lengths = torch.full((rows, width), width, dtype=torch.long, device=device)
    spans = zip(route.windows.tolist(), route.starts.tolist(), route.ends.tolist(), strict=True)
    for window, start, end in spans:
        lengths[window, start:end] = end - start
    keys = torch.arange(width, device=device)
    return (keys[None, None, :] >= lengths[:, :, None])[:, None]


def own_pad_ends(route: ClipRoute, width: int) -> torch.Tensor:
    """(C,) where each clip's own padding ends ("block-restart-ownpad"): the next clip's start
    in its window, or the window's end (`width` positions) after the window's last clip."""
    windows, starts, ends = route.windows.cpu(), route.starts.cpu(), route.ends.cpu()
    pad_ends = torch.full_like(ends, width)
    for clip in range(len(ends)):
        later = (windows == windows[clip]) & (starts >= ends[clip])
        if later.any():
            pad_ends[clip] = starts[later].min()
    return pad_ends.to(route.ends.device)


def tail_starts(route: ClipRoute) -> torch.Tensor:
    """(C,) where each clip's window's tail begins: the end of that window's last clip."""
    windows, ends = route.windows.to(route.ends.device), route.ends
    last = torch.zeros(int(windows.max()) + 1, dtype=ends.dtype, device=ends.device)
    return last.scatter_reduce(0, windows, ends, "amax")[windows]


def block_context(
    route: ClipRoute, windows: int, embed_positions: nn.Module
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The (W, S) block of each position of `route`'s windows (its clip's index; -1 in no clip;
    -2 in the window's tail with "-pad": `block_mask` turns them into the self-attention mask)
    and the (W, S) positions each clip's frames have alone: 0..n-1 (the others keep the
    window's). With "-ownpad" a clip's block is its frames and its own padding after them,
    positions 0..n+p-1. With SAMPLED_PAD too, but its p padding frames stand for the S - n
    positions of padding it has alone, spread evenly: the third value is the (W, S) number of
    positions each frame stands for (1 but there; None in other contexts), its first position
    the one in the second (`count_bias` turns the mask into the scores' bias)."""
    device = embed_positions.weight.device
    width = embed_positions.num_embeddings
    positions = torch.arange(width, device=device).repeat(windows, 1)
    blocks = torch.full((windows, width), -1, dtype=torch.long, device=device)
    sampled = route.context == SAMPLED_PAD
    ends = own_pad_ends(route, width) if route.context in (OWNPAD, SAMPLED_PAD) else route.ends
    spans = zip(route.windows.tolist(), route.starts.tolist(), ends.tolist(), strict=True)
    counts = torch.ones((windows, width), dtype=torch.long, device=device) if sampled else None
    for clip, (window, start, end) in enumerate(spans):
        blocks[window, start:end] = clip
        positions[window, start:end] -= start
        if sampled:  # the padding's p frames: S - n positions from n on, spread evenly
            clip_end = int(route.ends[clip])
            n, p = clip_end - start, end - clip_end
            edges = n + torch.arange(p + 1, device=device) * (width - n) // max(p, 1)
            positions[window, clip_end:end] = edges[:-1]
            counts[window, clip_end:end] = edges[1:] - edges[:-1]
    if route.context.endswith("-pad"):
        tails = tail_starts(route).tolist()
        for window, tail in zip(route.windows.tolist(), tails, strict=True):
            blocks[window, tail:] = -2
    return blocks, positions, counts


def block_mask(blocks: torch.Tensor, context: str) -> torch.Tensor:
    """The (W, 1, S, S) block-diagonal self-attention mask of `block_context`'s blocks: True
    where a query's position and a key's are in the same clip, or both in no clip; with "-pad",
    also where the query is in a clip and the key in its window's tail."""
    mask = blocks[:, :, None] == blocks[:, None, :]
    if context.endswith("-pad"):
        mask |= (blocks[:, :, None] >= 0) & (blocks[:, None, :] == -2)
    return mask[:, None]


def mean_embeddings(
    table: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """(..., d): for each entry the mean of `table`'s rows [position, position + count): a
    sample of padding standing for `count` positions carries their mean position embedding
    (Whisper's sinusoids: what varies faster than the samples averages out, not aliased)."""
    cumulative = torch.cat([table.new_zeros(1, table.shape[1]), table.cumsum(0)])
    return (cumulative[positions + counts] - cumulative[positions]) / counts[..., None]


def route_clips(whisper: nn.Module) -> ClipRouter:
    """The model's router, its hooks installed on first use (they stay: idle until armed)."""
    router = getattr(whisper, _ROUTER, None)
    if router is None:
        router = ClipRouter(whisper)
        encoder = whisper.model.encoder
        encoder.register_forward_pre_hook(router.encoder_pre_hook, with_kwargs=True)
        encoder.register_forward_hook(router.encoder_hook, with_kwargs=True)
        encoder.embed_positions.register_forward_hook(router.positions_hook)
        for layer in encoder.layers:
            layer.register_forward_pre_hook(router.encoder_layer_hook, with_kwargs=True)
            layer.self_attn.register_forward_pre_hook(router.self_attention_hook, with_kwargs=True)
            # An instance's forward (not the class's): the other attention modules, and this
            # one given anything but segments, run as they are.
            layer.self_attn.forward = types.MethodType(forward_with_segments, layer.self_attn)
        for layer in whisper.model.decoder.layers:
            layer.encoder_attn.register_forward_pre_hook(
                router.cross_attention_hook, with_kwargs=True
            )
        object.__setattr__(whisper, _ROUTER, router)  # not a submodule, not in the state dict
    return router


def encoder_context() -> str:
    """The encoder context of a run's per-clip windows: $WHISPER_TRAIN_PER_CLIP_ENCODER (for
    bench/quality.py's comparisons), else SAMPLED_PAD (`packing.per_clip_context`)."""
    context = per_clip_context()
    if context not in ENCODER_CONTEXTS:
        raise ValueError(f"{ENCODER_CONTEXT}={context}: expected one of {ENCODER_CONTEXTS}")
    return context


def encoder_rows_per_window(context: str) -> int:
    """Sequences per packed window whose activations the encoder keeps for backward: 2 where a
    silence window goes beside it in the windows' batch (SILENCE_DETACHED's keeps none)."""
    return 2 if context in SILENCE_IN_BATCH else 1


def clip_route(batch: dict) -> ClipRoute | None:
    """The route of a packed per-clip micro-batch; None for any other batch."""
    if "clip_windows" not in batch:
        return None
    positions = batch["clip_positions"]
    context = encoder_context()
    return ClipRoute(batch["clip_windows"], positions[:, 0], positions[:, 1], context)


@contextlib.contextmanager
def clips_routed(whisper: nn.Module, batch: dict) -> Iterator[None]:
    """Inside, the model's next forward routes `batch`'s clips (when it is a packed per-clip
    micro-batch; else nothing changes). The mask stays for the recomputations of backward."""
    route = clip_route(batch)
    if route is None:
        yield
        return
    router = route_clips(whisper)
    router.arm(route)
    try:
        yield
    finally:
        router.arm(None)  # a forward that failed before its encoder ran leaves nothing armed
