"""Packing short clips into 30-second windows: the encoder's work goes to speech, not padding.

Whisper's encoder always runs on 30 s (3000 log-mel frames; transformers refuses any other
length), so a 3 s clip costs the encoder as much as a 30 s one: on the clips users have (2-8 s)
80-90% of its work is on silence. `plan_windows` groups clips into windows of at most
`max_seconds` of audio (clips joined by `gap_seconds` of silence) and at most `max_tokens`
decoder positions (prefix included), by a seeded first fit over an order shuffled anew every
epoch, so that the same clips do not always share a window. The plan is a pure function of
(clip lengths, label lengths, seed, epoch): every process of a run computes the same windows,
and a resumed run the windows it was in the middle of.

distil-whisper's pseudo-labelling (`concatenate_audio`, on by default) trains on such windows;
Whisper itself was pretrained on 30 s windows holding several utterances.

A window's label is its clips' transcripts in order (`window_label`); with timestamps, Whisper's
multi-segment form, each clip a segment `<|start|> text <|end|>` at its place in the window:
drawn as for single clips with --timestamps, and always for a window of 2+ clips with
--packing-timestamps on (`window_timestamps`), whose clip times packing knows whatever the data.
Clips that already carry segments (subtitle-cut windows, up to 30 s) are left whole, one a
window, as are clips of another language than their neighbours would need (a window has one
language, the prefix's).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from whisper_train.audio import CHUNK_LENGTH, ENCODER_POSITIONS, SAMPLE_RATE
from whisper_train.data.labels import label_positions

# Silence between two clips of a window. 0.3 s: longer than the pause inside a sentence
# (~0.1-0.2 s), so a clip boundary still sounds like one, and short enough to cost little of
# the 30 s (a 3 s clip pays 10%). A choice, with its fill measured in BENCHMARKS.md.
DEFAULT_GAP_SECONDS = 0.3
# --packing per-clip's encoder context (`memory.clip_attention`), an internal switch for the
# measurement: with "block-restart-ownpad" each clip owns the silence after it, so its windows
# are planned with OWNPAD_GAP_SECONDS between two clips ($WHISPER_TRAIN_PER_CLIP_GAP: another
# gap, for any context).
PER_CLIP_ENCODER = "WHISPER_TRAIN_PER_CLIP_ENCODER"
OWNPAD = "block-restart-ownpad"
OWNPAD_GAP_SECONDS = 1.0
OWNPAD_GAP = "WHISPER_TRAIN_PER_CLIP_GAP"
# "block-restart-ownpad-sampled" (SAMPLED_PAD): each clip is followed in its window by padding of
# its own that stands for all the padding it has alone (the S - n encoder positions after its
# n), sampled every SAMPLED_PAD_STRIDE positions (`own_padding_seconds`), so its windows hold
# fewer clips; $WHISPER_TRAIN_PER_CLIP_STRIDE, another stride (for the measurement).
SAMPLED_PAD = "block-restart-ownpad-sampled"
SAMPLED_PAD_STRIDE = 8
SAMPLED_PAD_STRIDE_VARIABLE = "WHISPER_TRAIN_PER_CLIP_STRIDE"
# The context --packing per-clip uses unless $WHISPER_TRAIN_PER_CLIP_ENCODER names another:
# closest to unpacked training per clip seen of those measured (BENCHMARKS.md "Each clip alone,
# its padding sampled"), for LoRA and full fine-tuning alike.
DEFAULT_PER_CLIP_CONTEXT = SAMPLED_PAD


def per_clip_context() -> str:
    """--packing per-clip's encoder context (`memory.clip_attention`, which checks the name):
    $WHISPER_TRAIN_PER_CLIP_ENCODER, else DEFAULT_PER_CLIP_CONTEXT."""
    return os.environ.get(PER_CLIP_ENCODER) or DEFAULT_PER_CLIP_CONTEXT


# Windows kept open for a clip to fit into, per language: a larger number fills windows more
# tightly and costs a longer search per clip (first fit over at most this many).
OPEN_WINDOWS = 16

# --nonspeech's clips in --packing per-clip windows ("alongside", `plan_windows`' riders): they
# ride in the room the speech's windows leave, and only those that find none fill windows of
# their own; none counts as one of a step's clips. Each is at most NONSPEECH_PIECE_SECONDS long
# (`nonspeech.training_nonspeech` cuts longer files into pieces: short enough to fit the room a
# window of 3-5 s clips leaves, 1.5-3 s), and its own padding is sampled
# NONSPEECH_PADDING_STRIDE times more coarsely than speech's: a frame standing for more
# positions (`memory.clip_attention`'s counts), so a piece of noise takes about its own length
# of a window, not 2-3 times it. Speech keeps the fidelity its labels need; a clip whose target
# is "nothing" needs less. BENCHMARKS.md "Text where nobody speaks" measures what it teaches.
NONSPEECH_PIECE_SECONDS = 2.0
NONSPEECH_PADDING_STRIDE = 64


@dataclass(frozen=True)
class ClipSize:
    """What packing needs to know of one clip."""

    seconds: float  # audio length (after the worst-case slowing of augmentation)
    text_tokens: int  # its label's body (`labels.body_length`): no prefix, no <|endoftext|>
    language: str | None = None
    whole: bool = False  # a subtitle-cut window: never shares a window
    nonspeech: bool = False  # a clip of --nonspeech: a rider where `plan_windows` is given riders


def plan_windows(
    clips: Sequence[ClipSize],
    *,
    seed: int,
    epoch: int,
    prefix_tokens: int,
    max_tokens: int,
    max_seconds: float = CHUNK_LENGTH,
    gap_seconds: float = DEFAULT_GAP_SECONDS,
    timestamp_tokens: int = 0,
    padding_stride: int = 0,
    max_clips: int | None = None,
    riders: bool = False,
    spread_nonspeech: bool = False,
) -> list[tuple[int, ...]]:
    """The windows of one epoch: tuples of clip indices (in their order in the window).

    A window's label, `prefix_tokens` and a body of its clips' `text_tokens` (+
    `timestamp_tokens` per clip: 2 with timestamps), occupies at most `max_tokens` decoder
    positions (`labels.label_positions`); its audio, the clips plus a gap between each two, at
    most `max_seconds`; with a `padding_stride`, each clip's own padding after it counts too
    (`own_padding_seconds`). A clip too long for either alone still gets a window of its own
    (screening has already dropped clips over 30 s and labels over the limit). With
    `max_clips`, no window holds more clips than that: the clips a step asks for
    (`step_plan`), so that a step of few clips is not one window of many.
    Every clip is in exactly one window; windows are returned in a seeded random order.

    With `riders`, the clips marked `nonspeech` are planned after the others, which get the
    windows, in the order, they would get without them; then each rides in one of those
    windows with room left (one a window, last in it, not counted towards `max_clips`), and
    those that find none fill windows of their own (`max_clips` at most: no window has more
    decoder rows than a step's clips and a rider), placed in the order at seeded places
    (`_ride`). With `spread_nonspeech` (and no riders), the clips marked `nonspeech` are dealt
    evenly through the shuffled order of the others before the windows are filled, so that
    the windows share them about evenly (`step_plan.WholePlan` then orders the windows).
    """
    rng = random.Random(f"{seed}:{epoch}:packing")
    order = [i for i in range(len(clips)) if not (riders and clips[i].nonspeech)]
    rng.shuffle(order)
    if spread_nonspeech:  # the speech in its order, the noise dealt evenly through it
        order = dealt_evenly(
            [i for i in order if clips[i].nonspeech], [i for i in order if not clips[i].nonspeech]
        )
    windows: list[list[int]] = []
    # per language: open windows as [clip indices, seconds, tokens of their label's body]
    open_windows: dict[str | None, list[list]] = {}
    for index in order:
        clip = clips[index]
        body = clip.text_tokens + timestamp_tokens
        footprint = clip.seconds + own_padding_seconds(clip.seconds, padding_stride)
        if clip.whole or max_clips == 1:
            windows.append([index])
            continue
        candidates = open_windows.setdefault(clip.language, [])
        for window in candidates:
            members, seconds, used = window
            if (
                seconds + gap_seconds + footprint <= max_seconds
                and label_positions(prefix_tokens, used + body) <= max_tokens
            ):
                members.append(index)
                window[1] = seconds + gap_seconds + footprint
                window[2] = used + body
                if max_clips is not None and len(members) >= max_clips:  # full: closed now
                    windows.append(members)
                    candidates.remove(window)
                break
        else:
            candidates.append([[index], footprint, body])
            if len(candidates) > OPEN_WINDOWS:  # the fullest is closed: least room left
                fullest = max(range(len(candidates)), key=lambda i: candidates[i][1])
                windows.append(candidates.pop(fullest)[0])
    for language in open_windows:
        windows.extend(window[0] for window in open_windows[language])
    rng.shuffle(windows)
    if riders:
        windows = _ride(
            windows,
            clips,
            random.Random(f"{seed}:{epoch}:riders"),
            gap_seconds=gap_seconds,
            padding_stride=padding_stride,
            max_seconds=max_seconds,
            max_clips=max_clips,
        )
    return [tuple(window) for window in windows]


def dealt_evenly(extra: Sequence, order: list) -> list:
    """`order` with the items of `extra` placed at even intervals through it."""
    if not extra:
        return order
    merged, total = [], len(order) + len(extra)
    at = iter(math.floor((k + 0.5) * total / len(extra)) for k in range(len(extra)))
    next_at, rest, placed = next(at), iter(order), iter(extra)
    for position in range(total):
        if position == next_at:
            merged.append(next(placed))
            next_at = next(at, None)
        else:
            merged.append(next(rest))
    return merged


def footprint_seconds(clip: ClipSize, padding_stride: int) -> float:
    """What `clip` takes of a window: its audio and its own padding (a --nonspeech clip's at
    NONSPEECH_PADDING_STRIDE times the stride)."""
    if clip.nonspeech and padding_stride:
        padding_stride *= NONSPEECH_PADDING_STRIDE
    return clip.seconds + own_padding_seconds(clip.seconds, padding_stride)


def _ride(
    windows: list[list[int]],
    clips: Sequence[ClipSize],
    rng: random.Random,
    *,
    gap_seconds: float,
    padding_stride: int,
    max_seconds: float,
    max_clips: int | None,
) -> list[list[int]]:
    """`windows` (of speech, in their order) with the `nonspeech` clips of `clips` added: each,
    in a seeded order, rides in the next window (from where the last one rode, at most
    OPEN_WINDOWS looked at) that has none yet and room for its footprint; the rest fill
    windows of their own, first fit (`max_clips` at most), each inserted at a seeded place in
    the order."""
    riders = [i for i, clip in enumerate(clips) if clip.nonspeech]
    rng.shuffle(riders)
    used = [
        sum(footprint_seconds(clips[i], padding_stride) for i in window)
        + gap_seconds * (len(window) - 1)
        for window in windows
    ]
    carried = [False] * len(windows)
    left: list[int] = []
    at = 0
    for rider in riders:
        footprint = footprint_seconds(clips[rider], padding_stride)
        for step in range(min(OPEN_WINDOWS, len(windows))):
            k = (at + step) % len(windows)
            if not carried[k] and used[k] + gap_seconds + footprint <= max_seconds:
                windows[k].append(rider)
                carried[k] = True
                at = k + 1
                break
        else:
            left.append(rider)
    own: list[list] = []  # [clip indices, seconds]
    for rider in left:
        footprint = footprint_seconds(clips[rider], padding_stride)
        for window in own:
            full = max_clips is not None and len(window[0]) >= max_clips
            if not full and window[1] + gap_seconds + footprint <= max_seconds:
                window[0].append(rider)
                window[1] += gap_seconds + footprint
                break
        else:
            own.append([[rider], footprint])
    for members, _ in own:
        windows.insert(rng.randint(0, len(windows)), members)
    return windows


def per_clip_gap_seconds() -> float:
    """The silence between two clips of a --packing per-clip window: none with SAMPLED_PAD, the
    default (its clips' own padding lies between them), OWNPAD_GAP_SECONDS with
    "block-restart-ownpad", DEFAULT_GAP_SECONDS with another context; $OWNPAD_GAP, when set,
    for any context (the measurement's control: another context at the same gap)."""
    if os.environ.get(OWNPAD_GAP):
        return float(os.environ[OWNPAD_GAP])
    context = per_clip_context()
    if context == SAMPLED_PAD:  # each clip's own padding is what lies between two
        return 0.0
    return OWNPAD_GAP_SECONDS if context == OWNPAD else DEFAULT_GAP_SECONDS


def per_clip_padding_stride() -> int:
    """Every how many encoder positions a --packing per-clip window's clips have their own
    padding sampled: with the SAMPLED_PAD context (the default), SAMPLED_PAD_STRIDE or
    $WHISPER_TRAIN_PER_CLIP_STRIDE; 0 (none of its own) with another."""
    if per_clip_context() != SAMPLED_PAD:
        return 0
    return int(os.environ.get(SAMPLED_PAD_STRIDE_VARIABLE) or SAMPLED_PAD_STRIDE)


def own_padding_seconds(clip_seconds: float, stride: int) -> float:
    """The padding laid after a clip of `clip_seconds` in its window (SAMPLED_PAD): one
    encoder position (20 ms) for every `stride` of the S - n its padding alone would span; 0
    with no `stride`, and for a clip of 30 s or more (or of unknown length: infinite, a clip
    that failed its check and gets a window of its own)."""
    if not stride or not clip_seconds < CHUNK_LENGTH:
        return 0.0
    clip_positions = math.ceil(clip_seconds * ENCODER_POSITIONS / CHUNK_LENGTH)
    padding = math.ceil(max(ENCODER_POSITIONS - clip_positions, 0) / stride)
    return padding * CHUNK_LENGTH / ENCODER_POSITIONS


def window_seconds(
    clips: Sequence[ClipSize], window: Sequence[int], gap_seconds: float = DEFAULT_GAP_SECONDS
) -> float:
    """Audio in a window: its clips and the gaps between them."""
    return sum(clips[i].seconds for i in window) + gap_seconds * (len(window) - 1)


def windows_per_batch(batch_size: int, clip_counts: Sequence[int]) -> int:
    """The packed windows a micro-batch of `batch_size` clips takes: the nearest whole number
    to batch_size over the plan's mean clips a window (`clip_counts`: the clips each window
    counts), at least 1 (windows of one clip each: batch_size windows, as unpacked)."""
    clips = sum(clip_counts)
    if not clips:
        return batch_size
    return max(1, round(batch_size * len(clip_counts) / clips))


def fill_ratio(
    clips: Sequence[ClipSize],
    windows: Sequence[Sequence[int]],
    max_seconds: float = CHUNK_LENGTH,
) -> float:
    """Share of the encoder's input that is speech: clip seconds over windows x 30 s."""
    speech = sum(min(clip.seconds, max_seconds) for clip in clips)  # an unreadable one: inf
    return speech / (len(windows) * max_seconds) if windows else 0.0


class PackedWindow:
    """One packed window as it is built: clips laid out in the order added, `gap_seconds` of
    silence between two, then labelled by `item`. Data read whole (`SpeechDataset`) and a
    stream (`SpeechStream`) both build their windows with it, so a window's audio and label do
    not depend on how its clips were read."""

    def __init__(self, gap_seconds: float = DEFAULT_GAP_SECONDS, padding_stride: int = 0):
        self.gap = np.zeros(int(round(gap_seconds * SAMPLE_RATE)), dtype=np.float32)
        self.padding_stride = padding_stride  # each clip's own padding after it (SAMPLED_PAD)
        self.max_samples = int(CHUNK_LENGTH * SAMPLE_RATE)
        self.pieces: list[np.ndarray] = []  # clips and the gaps between them
        self.texts: list[str] = []
        self.spans: list[tuple[float, float]] = []  # each clip's (start, end) in seconds
        self.samples = 0

    def __len__(self) -> int:
        """Clips in the window."""
        return len(self.texts)

    def _next_start(self) -> int:
        return self.samples + (len(self.gap) if self.pieces else 0)

    def _own_padding(self, audio: np.ndarray, rider: bool) -> int:
        stride = self.padding_stride * (NONSPEECH_PADDING_STRIDE if rider else 1)
        seconds = own_padding_seconds(len(audio) / SAMPLE_RATE, stride)
        return int(round(seconds * SAMPLE_RATE))

    def fits(self, audio: np.ndarray, *, rider: bool = False) -> bool:
        """Whether `audio`, added next, would end (its own padding too) within the window; a
        `rider` (a --nonspeech clip riding, `plan_windows`) has its padding more coarsely."""
        end = self._next_start() + len(audio) + self._own_padding(audio, rider)
        return end <= self.max_samples

    def add(self, audio: np.ndarray, text: str, *, rider: bool = False) -> None:
        """Append a clip (whether it `fits` is the caller's to decide)."""
        start = self._next_start()
        if self.pieces:
            self.pieces.append(self.gap)
        self.pieces.append(audio)
        self.texts.append(text)
        self.spans.append((start / SAMPLE_RATE, (start + len(audio)) / SAMPLE_RATE))
        self.samples = start + len(audio)
        if padding := self._own_padding(audio, rider):
            self.pieces.append(np.zeros(padding, dtype=np.float32))
            self.samples += padding

    def audio(self) -> np.ndarray:
        """The window's samples: its clips and the gaps between them."""
        return np.concatenate(self.pieces)

    def item(self, label_encoder, *, language: str | None, rng, packing_timestamps: bool) -> dict:
        """{"audio", "tokens", "n_prefix", "text"} of a window of at least one clip; its label's
        form (timestamped or not) is drawn from `rng` (`window_timestamps`)."""
        timestamps = window_timestamps(
            label_encoder, len(self.texts), rng, packing_timestamps=packing_timestamps
        )
        tokens, n_prefix = window_label(
            label_encoder, self.texts, self.spans, language=language, timestamps=timestamps
        )
        return {
            "audio": self.audio(),
            "tokens": tokens,
            "n_prefix": n_prefix,
            "text": " ".join(text.strip() for text in self.texts),
        }


def window_label(
    label_encoder,
    texts: Sequence[str],
    spans: Sequence[tuple[float, float]],
    *,
    language: str | None,
    timestamps: bool,
) -> tuple[list[int], int]:
    """(token ids from <|startoftranscript|> to <|endoftext|>, prefix length) of one window.

    Without timestamps the transcripts follow each other, each with the leading space Whisper
    writes (`LabelEncoder.text_ids`), so the label decodes to the texts joined by spaces. With
    timestamps each clip is a segment `<|start|> text <|end|>`, times from the window's start.
    """
    if not any(text.strip() for text in texts):  # clips of --nonspeech alone: nobody speaks
        return label_encoder.nonspeech_label(language)
    prefix = label_encoder.prefix_ids(language, timestamps=timestamps)
    body: list[int] = []
    for text, (start, end) in zip(texts, spans, strict=True):
        if not text.strip():  # a clip of --nonspeech: no segment, silence like the gaps
            continue
        if timestamps:
            body.append(label_encoder.time_token_id(start))
        body += label_encoder.text_ids(text)
        if timestamps:
            body.append(label_encoder.time_token_id(end))
    return prefix + body + [label_encoder.eot_id], len(prefix)


def window_timestamps(label_encoder, n_clips: int, rng, *, packing_timestamps: bool) -> bool:
    """Whether a packed window's label takes the timestamp form.

    With `packing_timestamps` a window of 2+ clips always does (its clips' places in the window
    are known, whatever the data); otherwise, and for a window of one clip, it is drawn from
    `rng` as a single clip's is: with --timestamps, at `timestamp_probability`.
    """
    if packing_timestamps and n_clips > 1:
        return True
    return label_encoder.timestamps and (
        label_encoder.timestamp_probability >= 1.0
        or rng.random() < label_encoder.timestamp_probability
    )
