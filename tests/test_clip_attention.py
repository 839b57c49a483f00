"""Packed windows with one decoder pass per clip (`memory.clip_attention`): the routed loss is
the loss of each clip decoded alone on its own encoder positions, gradients included, with and
without checkpointing, on both attention kernels; and the hooks leave every other forward alone.

The reference runs the encoder on the windows, then the decoder once per clip on exactly that
clip's positions (no padding, no mask), and takes the token mean over all clips: what
`--packing per-clip` promises each step learns. Compared in float64, where a wrong position, a
mask that leaks onto padding or a recomputation without its mask is many orders of magnitude
above the rounding of two summation orders.

The block-diagonal encoder (`ENCODER_CONTEXT` block, block-restart, block-restart-pad: what
`--packing per-clip` does by default, block-restart-ownpad) is held to the same
standard: its reference runs each clip's frames alone through the encoder's layers (after the
window's convolutions), at the window's positions or at 0..n-1, then decodes it alone.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from tiny_models import EOT, LORA, SOT, fresh_short_whisper, nonzero_lora_b, trainable_gradients

from whisper_train.data.collate import IGNORE_INDEX
from whisper_train.data.packing import (
    OWNPAD_GAP,
    OWNPAD_GAP_SECONDS,
    SAMPLED_PAD,
    SAMPLED_PAD_STRIDE_VARIABLE,
    per_clip_gap_seconds,
    per_clip_padding_stride,
)
from whisper_train.memory import loss_terms, prepare_model
from whisper_train.memory.clip_attention import (
    ENCODER_CONTEXT,
    ENCODER_CONTEXTS,
    OWNPAD,
    SILENCE,
    SILENCE_DETACHED,
    SILENCE_SELF,
    ClipRoute,
    block_context,
    block_mask,
    block_segments,
    clip_route,
    count_bias,
    gather_clip_positions,
    gathered_counts,
    own_pad_ends,
    route_clips,
)
from whisper_train.memory.span_attention import EncoderSegments, segmented_attention
from whisper_train.memory.wrappers import whisper_of

# Two 1-second windows (50 encoder positions each): window 0 holds clips 0 and 1, window 1
# holds clip 2; clip lengths differ so that two of them are padded in the gathered keys.
SPANS = [(0, 0, 18), (0, 22, 47), (1, 5, 31)]  # (window, start, end) in encoder positions
LABELS = [[1000, 2000, 3000, EOT], [400, 500, EOT], [7, 8, 9, 10, 11, EOT]]


def packed_batch() -> dict:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 80, 100, generator=generator, dtype=torch.float64)
    width = max(len(label) for label in LABELS)
    labels = torch.full((len(LABELS), width), IGNORE_INDEX)
    for row, label in enumerate(LABELS):
        labels[row, : len(label)] = torch.tensor(label)
    decoder_input_ids = torch.cat([torch.full((len(LABELS), 1), SOT), labels[:, :-1]], dim=1)
    decoder_input_ids[decoder_input_ids == IGNORE_INDEX] = EOT
    return {
        "input_features": features,
        "decoder_input_ids": decoder_input_ids,
        "labels": labels,
        "clip_windows": torch.tensor([w for w, _, _ in SPANS]),
        "clip_positions": torch.tensor([[s, e] for _, s, e in SPANS]),
    }


def build(mode: str, checkpointing: str, attn: str) -> torch.nn.Module:
    model = fresh_short_whisper(attn).double()
    torch.manual_seed(1)
    model = prepare_model(model, mode=mode, checkpointing=checkpointing, lora=LORA)
    return nonzero_lora_b(model).train()


def clip_alone(whisper, features: torch.Tensor, span: tuple, context: str) -> torch.Tensor:
    """(1, n, d): one clip's frames through the encoder's layers with no other frame in
    sight, embedded at 0..n-1 (block-restart) or at its window's positions [start, end).
    block-restart-pad: (1, n + t, d), the clip followed by its window's tail (t positions
    from the window's last clip's end), which the clip's frames see and which sees only
    itself: the one mask here, built per clip, not per window. block-restart-ownpad:
    (1, n + p, d), the clip and its own padding (up to the next clip's start in its window, or
    the window's end), p frames that nothing else sees, all at 0..n+p-1 with no mask.
    block-restart-ownpad-sampled: (1, S, d), the clip and S - n frames of padding alone: its
    own padding's p frames, each repeated for the positions it stands for (S - n spread evenly
    over them from n on) and embedded at their mean position embedding, no mask: softmax over
    c copies of a key is softmax over one with log(c) added to its score, and the copies of a
    frame, given the same input and keys, stay copies through every layer."""
    encoder, attn = whisper.model.encoder, whisper.config._attn_implementation
    window, start, end = span
    embeds = torch.nn.functional.gelu(encoder.conv1(features[window : window + 1]))
    embeds = torch.nn.functional.gelu(encoder.conv2(embeds)).permute(0, 2, 1)
    positions = torch.arange(start, end) - (start if context != "block" else 0)
    frames, mask = torch.arange(start, end), None
    if context == OWNPAD:
        later = [s for w, s, _ in SPANS if w == window and s >= end]
        frames = torch.arange(start, min(later, default=embeds.shape[1]))
        positions = frames - start
    if context == "block-restart-pad":
        tail = max(e for w, _, e in SPANS if w == window)
        positions = torch.cat([positions, torch.arange(tail, embeds.shape[1])])
        frames = torch.cat([frames, torch.arange(tail, embeds.shape[1])])
        in_clip = torch.arange(len(frames)) < end - start
        mask = (in_clip[:, None] | ~in_clip[None, :])[None, None]
        if attn == "eager":
            mask = torch.zeros(mask.shape, dtype=embeds.dtype).masked_fill(~mask, -1e300)
    hidden = embeds[:, frames] + encoder.embed_positions.weight[positions]
    if context == SAMPLED_PAD:
        width, n = embeds.shape[1], end - start
        table = encoder.embed_positions.weight
        later = [s for w, s, _ in SPANS if w == window and s >= end]
        pad_frames = list(range(end, min(later, default=width)))
        edges = [n + j * (width - n) // len(pad_frames) for j in range(len(pad_frames) + 1)]
        padding = [
            (embeds[:, frame] + table[first:last].mean(0)).expand(last - first, -1)
            for frame, first, last in zip(pad_frames, edges, edges[1:], strict=False)
        ]
        hidden = torch.cat([embeds[:, start:end] + table[:n], torch.cat(padding)[None]], dim=1)
    for layer in encoder.layers:
        hidden = layer(hidden, mask)
    return encoder.layer_norm(hidden)


def clip_beside_silence(whisper, features: torch.Tensor, span: tuple) -> torch.Tensor:
    """(1, S, d): one clip's n frames at 0..n-1 through the encoder's layers, attending in
    each to themselves and to a silence window's frames n..S-1 at that layer (the silence
    window encoded alone, blind to the clip); then that silence window's outputs n..S-1."""
    encoder = whisper.model.encoder
    window, start, end = span
    n = end - start
    silence = torch.full_like(features[window : window + 1], float(features[window].min()))

    def embedded(frames):
        embeds = torch.nn.functional.gelu(encoder.conv1(frames))
        return torch.nn.functional.gelu(encoder.conv2(embeds)).permute(0, 2, 1)

    clip = embedded(features[window : window + 1])[:, start:end]
    clip = clip + encoder.embed_positions.weight[:n]
    quiet = (
        embedded(silence) + encoder.embed_positions.weight[: encoder.config.max_source_positions]
    )
    for layer in encoder.layers:
        clip = layer(torch.cat([clip, quiet[:, n:]], dim=1), None)[:, :n]
        quiet = layer(quiet, None)
    return encoder.layer_norm(torch.cat([clip, quiet[:, n:]], dim=1))


def reference_loss(model: torch.nn.Module, batch: dict, context: str = "window") -> torch.Tensor:
    """Each clip decoded alone on its own positions; the token mean over all of them."""
    whisper = whisper_of(model)
    encoded = whisper.model.encoder(batch["input_features"]).last_hidden_state
    total, tokens = 0.0, 0
    for row, (window, start, end) in enumerate(SPANS):
        keep = batch["labels"][row] != IGNORE_INDEX
        if context == "window":
            keys = encoded[window : window + 1, start:end]
        elif context in (SILENCE, SILENCE_DETACHED):  # the clip alone, then silence's n..S-1
            features = batch["input_features"][window : window + 1]
            silence = torch.full_like(features, float(features.min()))
            after = whisper.model.encoder(silence).last_hidden_state[:, end - start :]
            if context == SILENCE_DETACHED:  # the decoder learns from it, the encoder not
                after = after.detach()
            alone = clip_alone(whisper, batch["input_features"], SPANS[row], "block-restart")
            keys = torch.cat([alone, after], dim=1)
        elif context == SILENCE_SELF:
            keys = clip_beside_silence(whisper, batch["input_features"], SPANS[row])
        else:
            keys = clip_alone(whisper, batch["input_features"], SPANS[row], context)
        states = whisper.model.decoder(
            input_ids=batch["decoder_input_ids"][row : row + 1, : int(keep.sum())],
            encoder_hidden_states=keys,
        ).last_hidden_state[0]
        logits = whisper.proj_out(states)
        total = total + torch.nn.functional.cross_entropy(
            logits, batch["labels"][row][keep], reduction="sum"
        )
        tokens += int(keep.sum())
    return total / tokens


# Checkpointing off, on, and on with the layers' hooks run again by the recomputation.
CHECKPOINTING = ["off", "full", "full, hooks recomputed"]
CHECKPOINTING_IDS = ["off", "full", "full-hooks"]


def hooks_inside_the_checkpoint(monkeypatch) -> None:
    """A checkpointed layer as transformers 4.56 to 5.17 (at least) run it: the whole call,
    hooks included, inside the checkpoint, so its recomputation in backward runs its hooks again
    (5.24 checkpoints only `forward`, inside the hooks)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    def call(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            whole_call = functools.partial(torch.nn.Module.__call__, self, **kwargs)
            return self._gradient_checkpointing_func(whole_call, *args)
        return torch.nn.Module.__call__(self, *args, **kwargs)

    monkeypatch.setattr(GradientCheckpointingLayer, "__call__", call)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("checkpointing", CHECKPOINTING, ids=CHECKPOINTING_IDS)
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_routed_step_is_each_clip_decoded_alone(mode, checkpointing, attn, monkeypatch):
    if checkpointing == "full, hooks recomputed":
        hooks_inside_the_checkpoint(monkeypatch)
        checkpointing = "full"
    monkeypatch.setenv(ENCODER_CONTEXT, "window")  # the encoder on the whole window
    batch = packed_batch()
    reference = build(mode, "off", attn)
    expected = reference_loss(reference, batch)
    expected.backward()
    routed = build(mode, checkpointing, attn)
    loss = loss_terms(routed, batch).loss
    loss.backward()
    # float64: two summation orders of the same ~1e1 loss agree to ~1e-14.
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-10)
    got, want = trainable_gradients(routed), trainable_gradients(reference)
    assert got.keys() == want.keys() and all(g is not None for g in got.values())
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-8, atol=1e-10, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("checkpointing", CHECKPOINTING, ids=CHECKPOINTING_IDS)
@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("context", [c for c in ENCODER_CONTEXTS if c != "window"])
def test_a_block_diagonal_encoder_is_each_clip_encoded_alone(
    context, mode, checkpointing, attn, monkeypatch
):
    if checkpointing == "full, hooks recomputed":
        hooks_inside_the_checkpoint(monkeypatch)
        checkpointing = "full"
    batch = packed_batch()
    reference = build(mode, "off", attn)
    expected = reference_loss(reference, batch, context)
    expected.backward()
    monkeypatch.setenv(ENCODER_CONTEXT, context)
    routed = build(mode, checkpointing, attn)
    loss = loss_terms(routed, batch).loss
    loss.backward()
    # float64, as above: a frame that sees a neighbour's, a shifted position or a layer
    # recomputed without its mask moves the ~1e1 loss by far more than 1e-10 (on this tiny
    # random model the three contexts' losses differ by 1e-4 to 1e-2: six orders above the
    # tolerance, `test_the_block_context_is_not_the_window`).
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-10)
    got, want = trainable_gradients(routed), trainable_gradients(reference)
    assert got.keys() == want.keys() and all(g is not None for g in got.values())
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-8, atol=1e-10, msg=name)


def test_the_block_context_is_not_the_window(monkeypatch):
    """The parity above is not vacuous: each context gives another loss (the detached silence
    window, SILENCE's loss and other encoder gradients: below)."""
    batch = packed_batch()
    losses = []
    for context in (c for c in ENCODER_CONTEXTS if c != SILENCE_DETACHED):
        monkeypatch.setenv(ENCODER_CONTEXT, context)
        with torch.no_grad():
            losses.append(float(loss_terms(build("lora", "off", "sdpa"), batch).loss))
    assert min(abs(a - b) for a, b in zip(losses, losses[1:] + losses[:1], strict=True)) > 1e-6, (
        losses
    )


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_detached_silence_window_changes_only_the_encoders_gradients(mode, monkeypatch):
    """SILENCE_DETACHED is SILENCE's forward with no backward through the silence windows: the
    same loss and decoder gradients, and encoder gradients that differ (the parity above pins
    them to the clips' own frames' share)."""
    batch = packed_batch()
    results = {}
    for context in (SILENCE, SILENCE_DETACHED):
        monkeypatch.setenv(ENCODER_CONTEXT, context)
        model = build(mode, "full", "sdpa")
        loss = loss_terms(model, batch).loss
        loss.backward()
        results[context] = float(loss), trainable_gradients(model)
    (loss, grads), (detached_loss, detached_grads) = results[SILENCE], results[SILENCE_DETACHED]
    assert detached_loss == pytest.approx(loss, rel=0, abs=1e-10)  # float64, ~1e1
    encoder = [name for name in grads if ".encoder." in name]
    assert encoder and len(encoder) < len(grads)
    for name, grad in grads.items():
        if name in encoder:
            continue
        torch.testing.assert_close(detached_grads[name], grad, rtol=1e-8, atol=1e-10, msg=name)
    # every encoder weight also learned through the silence window under SILENCE: ~1e-3 apart
    assert all((detached_grads[n] - grads[n]).abs().max() > 1e-8 for n in encoder)


def test_per_clip_context_by_default_is_each_clip_with_its_padding_sampled(monkeypatch):
    """Whatever trains: each clip with its own padding, sampled (the closest to unpacked of
    those measured, BENCHMARKS.md); the bench's switch picks another."""
    monkeypatch.delenv(ENCODER_CONTEXT, raising=False)
    assert clip_route(packed_batch()).context == SAMPLED_PAD
    assert clip_route({"input_features": torch.zeros(1)}) is None
    monkeypatch.setenv(ENCODER_CONTEXT, OWNPAD)  # the bench's switch wins
    assert clip_route(packed_batch()).context == OWNPAD
    monkeypatch.setenv(ENCODER_CONTEXT, "block-restart-padding")
    with pytest.raises(ValueError, match="expected one of"):
        clip_route(packed_batch())


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_default_per_clip_step_routes_each_clip_with_its_padding_sampled(mode, monkeypatch):
    """Through `loss_terms`, LoRA or full: the per-clip loss is SAMPLED_PAD's, which differs
    from the contexts it replaced (block-restart-pad, block-restart-silence-detached)."""
    batch = packed_batch()
    model = build(mode, "off", "sdpa")
    losses = {}
    for context in ("", SAMPLED_PAD, "block-restart-pad", SILENCE_DETACHED):
        if context:
            monkeypatch.setenv(ENCODER_CONTEXT, context)
        else:
            monkeypatch.delenv(ENCODER_CONTEXT, raising=False)
        with torch.no_grad():
            losses[context] = float(loss_terms(model, batch).loss)
    assert losses[""] == losses[SAMPLED_PAD]
    assert losses[""] != losses["block-restart-pad"] and losses[""] != losses[SILENCE_DETACHED]


@pytest.mark.parametrize("context", [c for c in ENCODER_CONTEXTS if c != "block"])
def test_padding_is_hidden_and_the_hooks_leave_other_forwards_alone(context, monkeypatch):
    monkeypatch.setenv(ENCODER_CONTEXT, context)
    model = build("full", "full", "sdpa")
    batch = packed_batch()
    loss_terms(model, batch).loss.backward()  # installs and uses the hooks
    whisper = whisper_of(model)
    plain = {key: batch[key][:2] for key in ("decoder_input_ids", "labels")}
    plain["input_features"] = batch["input_features"]
    untouched = copy.deepcopy(fresh_short_whisper("sdpa")).double().train()
    untouched.load_state_dict(whisper.state_dict())
    # A batch of whole windows and their own labels, after a routed one: the hooks are idle.
    torch.testing.assert_close(
        loss_terms(model, plain).loss, loss_terms(untouched, plain).loss, rtol=0, atol=0
    )
    with torch.no_grad():
        generated = whisper.generate(batch["input_features"][:1], max_new_tokens=3)
        fresh = untouched.generate(batch["input_features"][:1], max_new_tokens=3)
    assert torch.equal(generated, fresh)
    assert route_clips(whisper) is route_clips(whisper)  # installed once


def test_gathered_positions_and_mask():
    encoded = torch.arange(2 * 6, dtype=torch.float32).view(2, 6, 1)
    route = ClipRoute(torch.tensor([0, 1]), torch.tensor([1, 0]), torch.tensor([4, 2]))
    keys, mask = gather_clip_positions(encoded, route)
    assert keys[..., 0].tolist() == [[1, 2, 3], [6, 7, 7]]  # the short clip padded by its last
    assert mask[:, 0, 0].tolist() == [[True, True, True], [True, True, False]]
    route.context = "block-restart-pad"  # then each window's tail: [4, 6) and [2, 6)
    keys, mask = gather_clip_positions(encoded, route)
    assert keys[..., 0].tolist() == [[1, 2, 3, 4, 5, 5, 5], [6, 7, 7, 8, 9, 10, 11]]
    assert mask[:, 0, 0].tolist() == [
        [True, True, True, True, True, False, False],
        [True, True, False, True, True, True, True],
    ]
    route.context = OWNPAD  # each clip and its own padding: [1, 6) and [0, 6)
    keys, mask = gather_clip_positions(encoded, route)
    assert keys[..., 0].tolist() == [[1, 2, 3, 4, 5, 5], [6, 7, 8, 9, 10, 11]]
    assert mask[:, 0, 0].tolist() == [[True] * 5 + [False], [True] * 6]


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_clip_with_all_its_padding_sampled_at_every_position_is_unpacked_training(
    mode, monkeypatch
):
    """SAMPLED_PAD's limit: a clip at the start of its window, its own padding the rest of the
    window (each frame standing for one position), is the clip alone in a padded window: the
    model's own forward on each window with its clip's label (unrouted), to float64 rounding."""
    batch = packed_batch()
    plain = {key: batch[key] for key in ("decoder_input_ids", "labels")}
    plain["input_features"] = batch["input_features"][[0, 1, 1]]
    alone = {**plain, "clip_windows": torch.arange(3)}
    alone["clip_positions"] = torch.tensor([[0, end - start] for _, start, end in SPANS])
    reference = build(mode, "off", "sdpa")
    expected = loss_terms(reference, plain).loss
    expected.backward()
    monkeypatch.setenv(ENCODER_CONTEXT, SAMPLED_PAD)
    routed = build(mode, "off", "sdpa")
    loss = loss_terms(routed, alone).loss
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-10)
    got, want = trainable_gradients(routed), trainable_gradients(reference)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-8, atol=1e-10, msg=name)


def test_sampled_padding_spreads_the_padding_a_clip_has_alone_over_its_own():
    """Window 0 of `SPANS`: clip 0 (18 positions) has 4 frames of its own padding for 32
    positions (8 each, from 18 on), clip 1 (25) has 3 for 25 (8, 8, 9, from 25 on); each
    clip's gathered keys stand for the 50 positions it has alone."""
    route = clip_route(packed_batch())
    route.context = SAMPLED_PAD
    table = torch.nn.Embedding(50, 4)
    blocks, positions, counts = block_context(route, 2, table)
    mask = block_mask(blocks, route.context)
    assert positions[0, 18:22].tolist() == [18, 26, 34, 42]
    assert counts[0, 18:22].tolist() == [8, 8, 8, 8]
    assert positions[0, 47:].tolist() == [25, 33, 41] and counts[0, 47:].tolist() == [8, 8, 9]
    assert positions[0, 22:47].tolist() == list(range(25)) and counts[0, :18].eq(1).all()
    assert mask[0, 0, 0, :22].all() and not mask[0, 0, 0, 22:].any()  # clip 0's own block
    keys, valid = gather_clip_positions(torch.zeros(2, 50, 1), route)
    weights = gathered_counts(counts, route, keys.shape[1])
    assert [int(weights[c][valid[c, 0, 0]].sum()) for c in range(3)] == [50, 50, 50]


def test_attention_span_by_span_is_the_block_diagonal_bias_and_its_gradients():
    """SAMPLED_PAD on sdpa attends span by span (`segmented_attention`), never building the
    (W, S, S) bias: the same outputs and gradients, in float64, as an encoder self-attention
    given `count_bias`'s block-diagonal bias; positions in no clip (window 1's first 5)
    attend among themselves in both."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperAttention

    route = clip_route(packed_batch())
    route.context = SAMPLED_PAD
    blocks, _, counts = block_context(route, 2, torch.nn.Embedding(50, 4))
    mask = block_mask(blocks, route.context)
    spans = block_segments(route, 2, 50)
    assert spans == (((0, 22), (22, 50)), ((0, 5), (5, 50)))
    config = WhisperConfig(d_model=16, encoder_attention_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    attention = WhisperAttention(16, 2, config=config).double()
    hidden = torch.randn(2, 50, 16, dtype=torch.float64, requires_grad=True)

    def output_and_gradients(run):
        attention.zero_grad()
        hidden.grad = None
        out = run()
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads = [p.grad.clone() for p in attention.parameters()]
        return out.detach(), hidden.grad.clone(), grads

    bias = count_bias(mask, counts[:, None, None, :], hidden)
    dense = output_and_gradients(lambda: attention(hidden_states=hidden, attention_mask=bias)[0])
    segments = EncoderSegments(spans, counts)
    segmented = output_and_gradients(lambda: segmented_attention(attention, hidden, segments)[0])
    torch.testing.assert_close(segmented[0], dense[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(segmented[1], dense[1], rtol=0, atol=1e-12)
    for got, want in zip(segmented[2], dense[2], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_clips_own_padding_ends_at_the_next_clip_or_the_windows_end():
    route = ClipRoute(*(torch.tensor(v) for v in ([0, 0, 1, 0], [0, 22, 5, 40], [18, 30, 31, 45])))
    assert own_pad_ends(route, 50).tolist() == [22, 40, 50, 50]


def test_the_per_clip_gap_follows_the_context(monkeypatch):
    """By default (SAMPLED_PAD) each clip's own padding lies between two clips: no gap of its
    own; block-restart-ownpad 1 s; the others 0.3 s."""
    monkeypatch.delenv(OWNPAD_GAP, raising=False)
    monkeypatch.delenv(ENCODER_CONTEXT, raising=False)
    monkeypatch.delenv(SAMPLED_PAD_STRIDE_VARIABLE, raising=False)
    assert per_clip_gap_seconds() == 0.0
    assert per_clip_padding_stride() == 8
    monkeypatch.setenv(ENCODER_CONTEXT, "block-restart-pad")
    assert per_clip_padding_stride() == 0
    assert per_clip_gap_seconds() == 0.3
    monkeypatch.setenv(ENCODER_CONTEXT, OWNPAD)
    assert per_clip_gap_seconds() == OWNPAD_GAP_SECONDS == 1.0
    monkeypatch.setenv(OWNPAD_GAP, "2.0")
    assert per_clip_gap_seconds() == 2.0
    monkeypatch.setenv(ENCODER_CONTEXT, "block-restart-pad")  # the control: same gap
    assert per_clip_gap_seconds() == 2.0
