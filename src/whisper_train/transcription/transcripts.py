"""A transcript and its files: txt, SRT, WebVTT, JSON (`whisper-train transcribe --format`).

With word timestamps, JSON gives each segment its `words` ([{word, start, end, probability?}]),
and SRT/WebVTT underline each word while it is spoken (openai-whisper's `--highlight_words`);
without them every file is as it always was.

Times are in milliseconds, the precision SRT and WebVTT carry: a `Segment` rounds its own times
and its words' once, where it is made, and keeps its words ordered inside it. Every backend of
`transcribe` builds its segments through it, so a word never starts before its segment by a
float's rounding (4.6 against 4.6000000000000005) in any file. A segment or word of no length
is left out of the timed files (`with_duration`): no cue ever starts where it ends.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from whisper_train.transcription.word_timestamps import Word, highlighted_cues

TRANSCRIPT_FORMATS = ("txt", "srt", "vtt", "json")


@dataclass(frozen=True)
class Segment:
    """One timed piece of a transcript. Made with any times, it holds them rounded to the
    millisecond, `end` no earlier than `start`, and its words each inside [start, end], in
    order, none starting before the previous one ends (word_timestamps.fit_into_segment's rule,
    which the transformers backend's words already follow)."""

    start: float  # seconds from the start of the recording
    end: float
    text: str
    words: tuple[Word, ...] | None = None  # with --word-timestamps only

    def __post_init__(self) -> None:
        start = _milliseconds(self.start)
        end = max(_milliseconds(self.end), start)
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)
        if self.words is None:
            return
        words, previous_end = [], start
        for word in self.words:
            word_start = min(max(_milliseconds(word.start), previous_end), end)
            word_end = min(max(_milliseconds(word.end), word_start), end)
            words.append(replace(word, start=word_start, end=word_end))
            previous_end = word_end
        object.__setattr__(self, "words", tuple(words))


def _milliseconds(seconds: float) -> float:
    """`seconds` rounded to the millisecond, as a Python float (a runtime may give numpy's)."""
    return round(float(seconds), 3)


@dataclass
class Transcript:
    """One recording: its text and timed segments, or the reason it failed (`error`)."""

    source: str
    name: str  # output file stem
    text: str = ""
    segments: list[Segment] = field(default_factory=list)
    error: str | None = None


# -- subtitle writers -----------------------------------------------------------------------


def format_timestamp(seconds: float, *, decimal_marker: str = ".") -> str:
    """3.5 → '00:00:03.500' (SRT uses ',' as the decimal marker, WebVTT '.')."""
    milliseconds = max(0, round(seconds * 1000))
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    secs, milliseconds = divmod(milliseconds, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_marker}{milliseconds:03d}"


def to_srt(segments: Sequence[Segment]) -> str:
    blocks = [
        f"{i}\n{format_timestamp(s.start, decimal_marker=',')} --> "
        f"{format_timestamp(s.end, decimal_marker=',')}\n{s.text}\n"
        for i, s in enumerate(segments, start=1)
    ]
    return "\n".join(blocks)


def to_vtt(segments: Sequence[Segment]) -> str:
    blocks = [
        f"{format_timestamp(s.start)} --> {format_timestamp(s.end)}\n{s.text}\n" for s in segments
    ]
    return "WEBVTT\n\n" + "\n".join(blocks)


def to_json(transcript: Transcript) -> str:
    payload = {
        "audio": transcript.source,
        "text": transcript.text,
        "segments": [_without_none(asdict(s)) for s in transcript.segments],
    }
    return json.dumps(payload, indent=2, ensure_ascii=False) + "\n"


def _without_none(value):
    """Drop unset optional fields (words, probability): the default output stays as it was."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return [_without_none(v) for v in value] if isinstance(value, (list, tuple)) else value


def with_duration(segments: Sequence[Segment]) -> list[Segment]:
    """`segments` and their words as the timed files hold them: only those that last a
    millisecond at least. A segment or word of no length (start == end: a 0.1 s clip's words
    all at its end, or text decoded on silence at the recording's end) is no cue a player can
    show and no time a reader can use; giving it a duration would invent one the model did
    not find. Its text stays in the transcript's text (txt, JSON's `text`)."""
    kept = []
    for segment in segments:
        if segment.end <= segment.start:
            continue
        words = segment.words
        if words is not None:
            words = tuple(word for word in words if word.end > word.start) or None
        kept.append(replace(segment, words=words) if words != segment.words else segment)
    return kept


def render(transcript: Transcript, output_format: str) -> str:
    segments = with_duration(transcript.segments)
    if any(s.words for s in segments):  # subtitles that underline each word as it is spoken
        segments = [Segment(start, end, text) for start, end, text in highlighted_cues(segments)]
    segments = [segment for segment in segments if segment.end > segment.start]
    if output_format == "srt":
        return to_srt(segments)
    if output_format == "vtt":
        return to_vtt(segments)
    if output_format == "json":
        return to_json(replace(transcript, segments=with_duration(transcript.segments)))
    return transcript.text + "\n"
