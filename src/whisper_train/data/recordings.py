"""Long recordings read whole, for long-form evaluation: one `Example` per recording with its
whole reference transcript, never cut into 30 s windows.

A folder of recordings, each with a transcript of the same stem beside it (`talk.wav` +
`talk.srt`, `talk.vtt` or `talk.txt`), gives one example per recording whose text is every cue
joined (or the whole .txt). Any other layout (a manifest whose rows are whole recordings, an
audiofolder...) is read as `load_examples` reads it, row by row. Training reads the same
subtitle folders through the `subtitles` layout instead, which packs cues into windows.
"""

from __future__ import annotations

import os
from pathlib import Path

from whisper_train.audio import AUDIO_SUFFIXES
from whisper_train.data.examples import Example
from whisper_train.data.layouts import load_examples
from whisper_train.data.manifests import read_text
from whisper_train.data.subtitles import SUBTITLE_SUFFIXES, parse_subtitles
from whisper_train.errors import UserError

TRANSCRIPT_SUFFIXES = (*SUBTITLE_SUFFIXES, ".txt")


def _transcript_pairs(folder: Path) -> list[tuple[Path, Path]]:
    """(audio, transcript) files of the same stem in `folder`, sorted by name; [] when none."""
    files = sorted(folder.iterdir())
    audio_by_stem = {p.stem: p for p in files if p.suffix.lower() in AUDIO_SUFFIXES}
    transcripts: dict[str, Path] = {}
    for path in files:
        suffix = path.suffix.lower()
        if suffix not in TRANSCRIPT_SUFFIXES:
            continue
        if path.stem not in audio_by_stem:
            if suffix == ".txt":
                continue  # a README.txt or notes: not every text file is a transcript
            raise UserError(
                f"{path}: no audio file with the same name; add it or remove the subtitle file"
            )
        if path.stem in transcripts:
            raise UserError(
                f"{path}: {audio_by_stem[path.stem].name} already has a transcript "
                f"({transcripts[path.stem].name}); keep one of the two"
            )
        transcripts[path.stem] = path
    return [(audio_by_stem[stem], transcripts[stem]) for stem in sorted(transcripts)]


def _reference(transcript: Path) -> str:
    """The whole reference of a recording: its cues joined in time order, or its .txt."""
    if transcript.suffix.lower() == ".txt":
        return " ".join(read_text(transcript).split())
    return " ".join(text for _, _, text in parse_subtitles(transcript))


def load_recordings(path: str | os.PathLike, *, data_format: str | None = None) -> list[Example]:
    """Every recording at `path`, whole: a folder of audio + .srt/.vtt/.txt pairs gives one
    example per pair (audio files with no transcript are refused: they cannot be scored);
    anything else is read by `load_examples`."""
    folder = Path(path)
    pairs = _transcript_pairs(folder) if data_format is None and folder.is_dir() else []
    if not pairs:
        return load_examples(path, data_format=data_format)
    paired = {audio for audio, _ in pairs}
    unpaired = [
        p
        for p in sorted(folder.iterdir())
        if p.suffix.lower() in AUDIO_SUFFIXES and p not in paired
    ]
    if unpaired:
        raise UserError(
            f"{unpaired[0]}: no transcript of the same name (.srt, .vtt or .txt) in {folder}; "
            "add one or move the recording out of the evaluation set"
        )
    examples = []
    for audio, transcript in pairs:
        text = _reference(transcript)
        if not text:
            raise UserError(f"{transcript}: empty transcript; a recording needs its reference")
        # Subtitles' cue times ride along: long-form scoring counts the text written between them.
        cues = () if transcript.suffix.lower() == ".txt" else tuple(parse_subtitles(transcript))
        examples.append(
            Example(audio=os.path.abspath(audio), text=text, segments=cues, origin=str(transcript))
        )
    return examples


__all__ = ["TRANSCRIPT_SUFFIXES", "load_recordings"]
