"""Long-form evaluation: recordings longer than Whisper's 30 s window, decoded as users decode
them (`transcription.longform`, the decoding `whisper-train transcribe` runs on a transformers
model) and scored whole.

Scoring: a recording is one utterance whose reference is its whole transcript, so its row's
WER is the WER over the whole recording, and the corpus figures of `scoring.score` add up the
recordings' errors. A dropped window shows as deletions, a repeated one as insertions: both
rates are reported. A recording with subtitles (.srt/.vtt) is also scored where its cues say
nobody speaks: the words of every decoded segment whose middle lies in a pause (`pauses`), per
minute of pause, as a non-speech set is scored (`scoring.score_nonspeech`).

Where long-form decoding happens: every clip of a set named NAME:long=PATH
(`config.LONG_FORM`, read whole by `data.recordings`), and in `evaluate` every clip longer than
30 s in any set: a clip is never scored on its first window only. During training a long-form
set is scored by `run_long_form_evaluation` (no validation loss: its labels would not fit the
decoder's 448 positions).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object

from whisper_train.audio import SAMPLE_RATE, load_audio
from whisper_train.errors import AudioError
from whisper_train.evaluation.scoring import (
    NonSpeechScores,
    Normalizer,
    get_normalizer,
    normalizer_for,
    score,
    score_nonspeech,
)
from whisper_train.transcription.assistant import Assistant
from whisper_train.transcription.decoding import Decoded, DecodingOptions, compression_ratio
from whisper_train.transcription.longform import (
    DecodedSegment,
    decoded_segments,
    generate_long_form,
)

# A long-form set is decoded one recording at a time (a recording is many windows already).
RECORDINGS_PER_BATCH = 1
# A pause: at least this long where no cue is, once CUE_MARGIN is taken off each end that meets
# a cue (a subtitler's times are good to a few hundred ms; Whisper's segment times to about as
# much). Shorter gaps are the breaths between sentences.
PAUSE_SECONDS = 2.0
CUE_MARGIN = 0.5


def pauses(cues: Sequence[tuple[float, float, str]], duration: float) -> list[tuple[float, float]]:
    """The (start, end) spans in seconds of a recording lasting `duration` s where its `cues`
    ((start, end, text)) say nobody speaks: before the first cue, between two, after the last."""
    found, heard_until = [], None
    for start, end, _ in sorted(cues):
        left = 0.0 if heard_until is None else heard_until + CUE_MARGIN
        if start - CUE_MARGIN - left >= PAUSE_SECONDS:
            found.append((left, start - CUE_MARGIN))
        heard_until = end if heard_until is None else max(heard_until, end)
    left = 0.0 if heard_until is None else heard_until + CUE_MARGIN
    if duration - left >= PAUSE_SECONDS:
        found.append((left, duration))
    return found


def text_in_pauses(
    segments: Sequence[DecodedSegment], spans: Sequence[tuple[float, float]]
) -> list[str]:
    """Per span, the text of the decoded segments whose middle lies in it."""
    return [
        " ".join(s.text for s in segments if start <= (s.start + s.end) / 2 < end)
        for start, end in spans
    ]


@dataclass
class Recordings:
    """Recordings decoded long-form: `texts[i]` is the transcript of `examples[i]`; the pauses
    of those with cue times, each's text and length (s), in order."""

    examples: list = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    decoded: list[Decoded] = field(default_factory=list)
    pause_texts: list[str] = field(default_factory=list)
    pause_seconds: list[float] = field(default_factory=list)

    @property
    def pause_scores(self) -> NonSpeechScores | None:
        """What the model wrote where the cues say nobody speaks (None: no recording has cue
        times, or none has a pause)."""
        if not self.pause_seconds:
            return None
        return score_nonspeech(self.pause_texts, self.pause_seconds)


def decode_recordings(
    model,
    processor,
    examples: Iterable,
    *,
    beam_size: int = 1,
    decoding: DecodingOptions | None = None,
    condition_on_previous_text: bool = False,
    languages: Sequence[str | None] | None = None,
    skipped: list[dict] | None = None,
    progress: bool = False,
    assistant: Assistant | None = None,
) -> Recordings:
    """Decode each example (a recording, or a window of one) long-form. Unreadable audio is
    appended to `skipped` ({"audio", "reason"}) and left out. `languages[i]`: the language of
    example i on a multilingual model (None: the model's, else detected). `progress`: a line on
    stderr per recording (a long recording takes a while)."""
    decoding = DecodingOptions() if decoding is None else decoding
    was_training = model.training
    model.eval()
    found = Recordings()
    started = time.perf_counter()
    examples = list(examples)
    try:
        for index, example in enumerate(examples):
            try:
                audio = load_audio(example.audio, start=example.start, end=example.end)
            except AudioError as exc:
                if skipped is not None:
                    skipped.append({"audio": example.audio, "reason": exc.reason})
                continue
            language = languages[index] if languages is not None else None
            output = generate_long_form(
                model,
                processor,
                audio,
                beam_size=beam_size,
                decoding=decoding,
                condition_on_previous_text=condition_on_previous_text,
                language=language,
                assistant=assistant,
            )
            segments = decoded_segments(output, processor.tokenizer)
            text = " ".join(segment.text for segment in segments)
            found.examples.append(example)
            found.texts.append(text)
            if example.segments:  # the cues of its subtitles
                spans = pauses(example.segments, len(audio) / SAMPLE_RATE)
                found.pause_texts += text_in_pauses(segments, spans)
                found.pause_seconds += [end - start for start, end in spans]
            # The fallback ran window by window inside generate, which does not say which
            # windows needed it: the recording is reported at its first temperature.
            found.decoded.append(
                Decoded(
                    text=text,
                    tokens=(),
                    avg_logprob=None,
                    compression_ratio=compression_ratio(text),
                    temperature=decoding.temperatures[0],
                    language=language,
                )
            )
            if progress:
                print(
                    f"evaluate: {index + 1} of {len(examples)} recordings decoded long-form "
                    f"({len(audio) / SAMPLE_RATE:.0f} s) in {time.perf_counter() - started:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        model.train(was_training)
    return found


def collate_recordings(items: list[tuple[int, object]]) -> dict:
    """A batch of a long-form set's loader: (index in the set, example) pairs, unread (each
    recording's audio is read as it is decoded). `size` 0: a share padded to the others'."""
    return {"items": items, "size": len(items)}


@torch.no_grad()
def run_long_form_evaluation(
    model,
    loader,
    processor,
    accelerator,
    normalizer: Normalizer | None,
    step: int,
    *,
    decoding: DecodingOptions | None = None,
    condition_on_previous_text: bool = False,
    languages: Sequence[str | None] | None = None,
) -> dict:
    """A long-form set's metrics row during training: {"step", "eval_loss" (NaN: none is
    computed), "wer", "clips", "long_form": True, "repeated_ngram_rate", "insertion_rate",
    "deletion_rate"}.

    `loader` yields this process's share (`collate_recordings` batches, from
    `data.source.evaluation_loader`: every process the same number of batches, some empty).
    Whatever its share, every process joins the one gather at the end, and only it: decoding
    runs on the unwrapped model, whose forwards hold no collective."""
    unwrapped = accelerator.unwrap_model(model)
    references, hypotheses, decoded, pause_texts, pause_seconds = [], [], [], [], []
    for batch in loader:
        if not batch["size"]:
            continue
        indices = [index for index, _ in batch["items"]]
        found = decode_recordings(
            unwrapped,
            processor,
            [example for _, example in batch["items"]],
            decoding=decoding,
            condition_on_previous_text=condition_on_previous_text,
            languages=[languages[i] for i in indices] if languages is not None else None,
        )
        references += [example.text for example in found.examples]
        hypotheses += found.texts
        decoded += found.decoded
        pause_texts += found.pause_texts
        pause_seconds += found.pause_seconds
    if accelerator.num_processes > 1:
        shares = gather_object([(references, hypotheses, decoded, pause_texts, pause_seconds)])
        references, hypotheses, decoded, pause_texts, pause_seconds = (
            [item for share in shares for item in share[column]] for column in range(5)
        )
    if not references:
        return {"step": step, "eval_loss": math.nan, "wer": math.nan, "long_form": True}
    if normalizer is None:
        normalizer = get_normalizer(normalizer_for(item.language for item in decoded))
    scores = score(references, hypotheses, normalizer=normalizer)
    row = {
        "step": step,
        "eval_loss": math.nan,  # teacher forcing needs labels within 448 decoder positions
        "wer": round(scores.wer, 6),
        "clips": len(references),
        "long_form": True,
        "repeated_ngram_rate": round(scores.repeated_ngram_rate, 6),
        "insertion_rate": round(scores.insertion_rate, 6),
        "deletion_rate": round(scores.deletion_rate, 6),
    }
    if pause_seconds:  # recordings with cue times: the text written in their pauses
        row.update(pause_figures(score_nonspeech(pause_texts, pause_seconds)))
    return row


def pause_figures(scores: NonSpeechScores) -> dict:
    """A set's pause figures, as report.json and metrics.jsonl write them."""
    return {
        "pause_minutes": round(scores.seconds / 60, 4),
        "pause_words": scores.words,
        "pause_words_per_minute": round(scores.words_per_minute, 4),
    }


__all__ = [
    "RECORDINGS_PER_BATCH",
    "Recordings",
    "collate_recordings",
    "decode_recordings",
    "pause_figures",
    "pauses",
    "run_long_form_evaluation",
    "text_in_pauses",
]
