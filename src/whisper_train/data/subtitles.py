"""Subtitled recordings → examples: SRT/WebVTT cues parsed, and the timed segments of a long
recording (cues, or rows of a manifest) packed into windows of at most 30 s.

The `subtitles` layout reads a folder of recordings with .srt/.vtt files of the same stem, or a
manifest whose rows are timed segments of long recordings.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from whisper_train.audio import AUDIO_SUFFIXES, CHUNK_LENGTH
from whisper_train.data.examples import Example
from whisper_train.data.manifests import read_manifest, read_text
from whisper_train.errors import UserError

SUBTITLE_SUFFIXES = (".srt", ".vtt")
# Subtitle cues may touch; a millisecond of overlap is rounding in the file, not a mistake.
OVERLAP_TOLERANCE = 1e-3


_CUE_TIME = re.compile(
    r"^\s*((?:\d+:)?\d{1,2}:\d{2}[,.]\d{1,3})\s*-->\s*((?:\d+:)?\d{1,2}:\d{2}[,.]\d{1,3})"
)
_MARKUP = re.compile(r"<[^>]*>|\{\\[^}]*\}")  # <i>, <v Speaker>, <00:01.000>, {\an8}


def _seconds(stamp: str) -> float:
    """'01:02:03,450' / '02:03.450' → seconds."""
    parts = stamp.replace(",", ".").split(":")
    seconds = 0.0
    for part in parts:
        seconds = seconds * 60 + float(part)
    return seconds


def parse_subtitles(path: str | Path) -> list[tuple[float, float, str]]:
    """(start, end, text) per cue of an SRT or WebVTT file, in file order.

    Markup (<i>, <v Name>, {\\an8}) is removed and a cue's lines are joined by spaces; cues
    without text are dropped. Backwards or overlapping times are a UserError: they would put
    words in the wrong window.
    """
    path = Path(path)
    cues: list[tuple[float, float, str]] = []
    lines = read_text(path).splitlines()
    number = 0
    while number < len(lines):
        match = _CUE_TIME.match(lines[number])
        number += 1
        if not match:
            continue  # WEBVTT header, NOTE/STYLE blocks, cue numbers and identifiers
        cue_line = number
        start, end = _seconds(match.group(1)), _seconds(match.group(2))
        text_lines = []
        while number < len(lines) and lines[number].strip():
            text_lines.append(lines[number].strip())
            number += 1
        if end <= start:
            raise UserError(
                f"{path}:{cue_line}: cue ends ({match.group(2)}) before it starts "
                f"({match.group(1)}); fix the times"
            )
        if cues and start < cues[-1][1] - OVERLAP_TOLERANCE:
            raise UserError(
                f"{path}:{cue_line}: cue starts ({match.group(1)}) before the previous cue ends; "
                "subtitles must not overlap (merge or re-time the cues)"
            )
        text = " ".join(_MARKUP.sub("", " ".join(text_lines)).split())
        if text:
            cues.append((start, end, text))
    return cues


def pack_segments(
    audio: str,
    segments: Sequence[tuple[float, float, str]],
    *,
    origin: str,
    max_seconds: float = CHUNK_LENGTH,
    language: str | None = None,
) -> list[Example]:
    """Pack consecutive timed segments of one recording into windows of at most `max_seconds`.

    Windows are cut only at segment boundaries. Each Example spans its first segment's start
    to its last segment's end; its `segments` are relative to the window start, and its
    `previous_text` is the window before's text (what long-form decoding has just written). A segment longer
    than `max_seconds` becomes a window of its own, which screening then reports as too long.
    """
    windows: list[list[tuple[float, float, str]]] = []
    for segment in sorted(segments):
        if windows and segment[1] - windows[-1][0][0] <= max_seconds:
            windows[-1].append(segment)
        else:
            windows.append([segment])
    examples = []
    previous_text = None  # the window before, of the same recording: its prompt in training
    for window in windows:
        start, end = window[0][0], window[-1][1]
        examples.append(
            Example(
                audio=audio,
                text=" ".join(text for _, _, text in window),
                language=language,
                start=start,
                end=end,
                duration=end - start,
                segments=tuple(
                    (round(s - start, 3), round(e - start, 3), text) for s, e, text in window
                ),
                origin=f"{origin} ({start:.2f}-{end:.2f} s)",
                previous_text=previous_text,
            )
        )
        previous_text = examples[-1].text
    return examples


def _subtitle_pairs(folder: Path) -> list[tuple[Path, Path]]:
    """(audio, subtitle) files of the same stem in `folder`."""
    audio_by_stem = {
        p.stem: p for p in sorted(folder.iterdir()) if p.suffix.lower() in AUDIO_SUFFIXES
    }
    pairs = []
    for subtitle in sorted(folder.iterdir()):
        if subtitle.suffix.lower() not in SUBTITLE_SUFFIXES:
            continue
        if subtitle.stem not in audio_by_stem:
            raise UserError(
                f"{subtitle}: no audio file with the same name (looked for "
                f"{', '.join(subtitle.stem + s for s in AUDIO_SUFFIXES)}); add it or remove "
                "the subtitle file"
            )
        pairs.append((audio_by_stem[subtitle.stem], subtitle))
    return pairs


def detect_subtitles(path: Path) -> bool:
    return path.is_dir() and any(p.suffix.lower() in SUBTITLE_SUFFIXES for p in path.iterdir())


def read_subtitles(path: Path) -> list[Example]:
    if path.is_file():  # a manifest of timed segments: group the rows by recording
        return _group_manifest_segments(path, read_manifest(path))
    examples = []
    for audio, subtitle in _subtitle_pairs(path):
        examples += pack_segments(
            os.path.abspath(audio), parse_subtitles(subtitle), origin=str(subtitle)
        )
    return examples


def _group_manifest_segments(path: Path, rows: list[Example]) -> list[Example]:
    by_audio: dict[str, list[Example]] = defaultdict(list)
    for row in rows:
        if row.start is None or row.end is None:
            raise UserError(
                f"{row.origin}: malformed row: the subtitles format needs start and end (or "
                "offset and duration) on every row"
            )
        by_audio[row.audio].append(row)
    examples = []
    for audio, segments in by_audio.items():
        timed = sorted((row.start, row.end, row.text) for row in segments)
        for previous, current in zip(timed, timed[1:], strict=False):
            if current[0] < previous[1] - OVERLAP_TOLERANCE:
                raise UserError(
                    f"{path}: segments of {audio} overlap at {current[0]} s; segments must not "
                    "overlap (merge or re-time them)"
                )
        examples += pack_segments(audio, timed, origin=f"{path}", language=segments[0].language)
    return examples
