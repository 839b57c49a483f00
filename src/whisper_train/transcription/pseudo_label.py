"""Pseudo-labels: a model's transcripts of audio, written as a manifest `train --data` reads.

    pseudo_label(model, data, output)     # → PseudoLabelResult

`data` is what `train --data` reads (`data.layouts.load_examples`: a folder with its
transcripts, a manifest, subtitled recordings, ...), a manifest with an audio column and no
text column, a plain folder of audio files (searched as `transcribe` searches one) or one audio
file. Each clip is decoded as `transcribe` decodes it (`load_backend`: the runtime of the
model's format, faster-whisper for a CTranslate2 folder; `longform.transcribe_in_pieces`), and
its rows are appended to `output`, a JSONL manifest whose fields are those the manifests
whisper-train reads (`data.manifests`):

    audio          the clip's file (absolute path)
    text           the model's transcript: the training text
    start, end     the window of the file, where the clip is one (or the rows cut it)
    duration       seconds of audio the row covers
    language       --language, or the input's own, where known
    previous_text  what was said just before (the input's, or the row before of the same
                   recording): `train --prompt-probability` reads it
    reference_text the transcript the input already had (a manifest's text, subtitles): kept
                   beside the model's, never trained on
    wer            the model's text against `reference_text`, both normalised as `evaluate`
                   normalises them (`evaluation.scoring`: English or basic by the language)

A clip of at most 30 s is one row. A longer recording is cut at the model's segment times into
windows of at most 30 s (`subtitles.pack_segments`), one row each, with the window before as
`previous_text`. With `timestamps`, every decoded segment is a row of its own, timed within the
file: `train --data FILE --data-format subtitles --timestamps` packs them into windows and
trains their time tokens. Rows cut from one clip carry the clip's reference and WER.

What is not written: a clip where the model wrote nothing (no speech: a manifest row with empty
text would be screened out by `train` as an empty transcript; non-speech is trained from
`--nonspeech` sets, `data.nonspeech`), a clip whose WER is over `max_wer` (a reference that is
empty after normalisation counts as over it when the model wrote words), and a clip that cannot
be read (named in the result; a later run tries it again).

Resuming: beside the output, `<output>.progress` records the settings that made the labels
(the model, language, task, decoding) on its first line, then one line per clip done, written
after the clip's rows are flushed, with the output's length in bytes at that point. A run that
finds both continues where they end: the output is cut back to the last clip recorded (dropping
the rows of a clip cut short, and a half-written line), and the clips recorded are not decoded
again, so a kill at any point loses no clip and labels none twice. Other settings than
recorded are refused in one line unless `overwrite`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from whisper_train.audio import AUDIO_SUFFIXES, CHUNK_LENGTH, SAMPLE_RATE, audio_pieces
from whisper_train.data.examples import Example
from whisper_train.data.layouts import LAYOUTS, load_examples
from whisper_train.data.manifests import (
    AUDIO_COLUMNS,
    TEXT_COLUMNS,
    manifest_examples,
    read_rows,
)
from whisper_train.data.subtitles import pack_segments
from whisper_train.errors import AudioError, UserError
from whisper_train.evaluation.scoring import get_normalizer, word_counts
from whisper_train.files import check_output_path
from whisper_train.runlog import progress_bars_wanted
from whisper_train.transcription.decoding import DecodingOptions
from whisper_train.transcription.longform import PIECE_SECONDS, transcribe_in_pieces
from whisper_train.transcription.transcribe import load_backend
from whisper_train.transcription.transcripts import Segment

PROGRESS_SUFFIX = ".progress"  # <output>.progress: the settings, then one line per clip done
# What a clip became (a progress line's `outcome`).
WRITTEN, OVER_MAX_WER, NO_SPEECH = "written", "over max-wer", "no speech"
# The shortest timed row: a segment shorter than one time token is merged into its neighbour
# (a manifest row must end after it starts).
SHORTEST_ROW = 0.02
SHARD_SUFFIXES_REFUSED = (".tar", ".parquet")  # streams: audio held in shards, not files


@dataclass(frozen=True)
class Clip:
    """One clip to label: a file, or the window [start, end) s of one."""

    key: str  # its name in the progress record: the path, its window, a count for repeats
    audio: str
    start: float | None = None
    end: float | None = None
    reference: str | None = None  # the transcript the input had; None: it had none
    language: str | None = None
    previous_text: str | None = None


@dataclass(frozen=True)
class Settings:
    """What made the labels; a resumed run must ask for the same (`<output>.progress`)."""

    model: str
    language: str | None
    task: str | None
    beam_size: int
    timestamps: bool
    max_wer: float | None
    temperatures: list[float]
    compression_ratio_threshold: float | None
    logprob_threshold: float | None
    no_speech_threshold: float | None


@dataclass
class PseudoLabelResult:
    """What a run did; the counts are this run's, `already_done` what earlier runs did."""

    output: Path
    progress_file: Path
    clips: int  # clips in the input
    already_done: int  # recorded by earlier runs of the same command
    labelled: int = 0  # clips written by this run
    rows: int = 0  # rows written by this run
    over_max_wer: int = 0
    no_speech: int = 0
    compared: int = 0  # clips this run scored against a reference
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (audio, why): not written
    audio_seconds: float = 0.0  # audio decoded by this run
    seconds: float = 0.0  # wall time of this run's decoding


# -- the clips ------------------------------------------------------------------------------
def collect_clips(data: str | os.PathLike, data_format: str | None = None) -> list[Clip]:
    """Every clip of `data`, in the order the input lists them (a folder's files sorted)."""
    path = Path(data)
    if data_format is None and path.is_file() and path.suffix.lower() in AUDIO_SUFFIXES:
        return _keyed([Example(audio=os.path.abspath(path), text="")], references=False)
    if data_format is None and path.is_dir() and not _a_layout(path):
        return _keyed(_audio_files(path), references=False)
    unlabelled = _unlabelled_manifest(path, data_format)
    if unlabelled is not None:
        return _keyed(unlabelled, references=False)
    return _keyed(load_examples(data, data_format=data_format), references=True)


def _a_layout(path: Path) -> bool:
    """Whether a layout `train` reads recognises `path` (else it is a plain folder of audio)."""
    return any(layout.detect(path) for layout in LAYOUTS.values())


def _audio_files(folder: Path) -> list[Example]:
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES)
    if not files:
        if any(p.suffix.lower() in SHARD_SUFFIXES_REFUSED for p in folder.rglob("*")):
            raise UserError(
                f"--data {folder}: a stream of shards; pseudo-label writes rows that point at "
                "audio files: extract the clips to a folder first"
            )
        raise UserError(
            f"--data {folder}: no audio files ({', '.join(AUDIO_SUFFIXES[:4])}, ...) in this "
            "folder; pass a folder of audio, a manifest or a data layout train reads"
        )
    return [Example(audio=os.path.abspath(p), text="") for p in files]


def _unlabelled_manifest(path: Path, data_format: str | None) -> list[Example] | None:
    """The rows of a manifest with an audio column and no text column; None for any other
    input (a manifest with text is read as `train` reads it)."""
    suffix = path.suffix.lower()
    manifest = data_format in (None, "jsonl", "csv", "tsv") and path.is_file()
    if not manifest or suffix not in (".jsonl", ".json", ".csv", ".tsv"):
        return None
    if data_format is None and LAYOUTS["lhotse"].detect(path):
        return None
    rows = read_rows(path, {".csv": ",", ".tsv": "\t"}.get(suffix))
    first = next(rows, None)
    if first is None or any(column in first[1] for column in TEXT_COLUMNS):
        return None
    untexted = ((line, {**row, "text": ""}) for line, row in itertools.chain([first], rows))
    return manifest_examples(path, untexted, AUDIO_COLUMNS)


def _keyed(examples: Iterable[Example], *, references: bool) -> list[Clip]:
    clips, seen = [], {}
    for example in examples:
        key = example.audio
        if example.start is not None or example.end is not None:
            key += f"@{example.start or 0.0:.3f}-{example.end or 0.0:.3f}"
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:  # the same clip listed again: labelled again, as train reads it again
            key += f"#{seen[key]}"
        clips.append(
            Clip(
                key=key,
                audio=example.audio,
                start=example.start,
                end=example.end,
                reference=example.text if references else None,
                language=example.language,
                previous_text=example.previous_text,
            )
        )
    return clips


# -- the progress record --------------------------------------------------------------------
class Progress:
    """`<output>.progress` and the output it describes: what is done, and appending to both."""

    def __init__(self, output: Path, settings: Settings, *, overwrite: bool):
        self.output = output
        self.path = output.with_name(output.name + PROGRESS_SUFFIX)
        self.settings = settings
        self.done: set[str] = set()
        if overwrite:
            for stale in (output, self.path):
                stale.unlink(missing_ok=True)
        self._open_existing()

    def _open_existing(self) -> None:
        if not self.path.is_file() or not self.output.is_file():
            if self.output.is_file() and self.output.stat().st_size > 0:
                raise UserError(
                    f"--output {self.output}: exists and was not written by pseudo-label (no "
                    f"{self.path.name} beside it); choose another --output, or pass --overwrite "
                    "to replace it"
                )
            self._start()
            return
        lines, kept = _whole_lines(self.path)
        if not lines:  # killed while the header was written: nothing was labelled
            self._start()
            return
        try:
            header, *records = [json.loads(line) for line in lines]
            end = records[-1]["end"] if records else 0
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(
                f"{self.path}: not a progress record pseudo-label wrote; pass --overwrite to "
                "label again"
            ) from None
        self._check_settings(header.get("settings", {}))
        if self.output.stat().st_size < end:
            raise UserError(
                f"--output {self.output}: shorter than {self.path.name} records (was it "
                "edited?); pass --overwrite to label again"
            )
        # Cut back to the last clip recorded: a clip's rows after it, or a half-written line.
        os.truncate(self.output, end)
        os.truncate(self.path, kept)
        self.done = {record["clip"] for record in records}
        self._outputs = self._opened("ab")

    def _start(self) -> None:
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self._outputs = self._opened("wb")
        header = {"pseudo_label": 1, "settings": asdict(self.settings)}
        self._append(self._outputs[1], json.dumps(header) + "\n")

    def _opened(self, mode: str) -> tuple:
        """The output and the record, opened in `mode`, closed together by `close`."""
        self._files = contextlib.ExitStack()
        return tuple(self._files.enter_context(p.open(mode)) for p in (self.output, self.path))

    def _check_settings(self, recorded: dict) -> None:
        asked = asdict(self.settings)
        for name, flag in SETTING_FLAGS.items():
            if recorded.get(name) != asked[name]:
                raise UserError(
                    f"--output {self.output}: labelled with {flag} {_shown(recorded.get(name))}"
                    f", not {_shown(asked[name])}; pass --overwrite to label it again, or "
                    "choose another --output"
                )

    def record(self, clip: Clip, rows: list[dict], outcome: str) -> None:
        """Append the clip's rows, then the line that says it is done (each flushed to disk)."""
        manifest, progress = self._outputs
        self._append(manifest, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        line = {"clip": clip.key, "outcome": outcome, "rows": len(rows), "end": manifest.tell()}
        self._append(progress, json.dumps(line, ensure_ascii=False) + "\n")
        self.done.add(clip.key)

    def _append(self, file, text: str) -> None:
        if not text:
            return
        try:
            file.write(text.encode("utf-8"))
            file.flush()
            os.fsync(file.fileno())
        except OSError as exc:  # a full disk, a quota: what is recorded stays, a rerun goes on
            raise UserError(
                f"--output {self.output}: cannot write ({exc.strerror or exc}); make room and "
                "run the same command again: it continues after the last clip recorded"
            ) from None

    def close(self) -> None:
        self._files.close()


# The recorded settings, and the flag that asks for each (a refusal names it).
SETTING_FLAGS = {
    "model": "--model",
    "language": "--language",
    "task": "--task",
    "beam_size": "--beam-size",
    "timestamps": "--timestamps",
    "max_wer": "--max-wer",
    "temperatures": "--temperatures",
    "compression_ratio_threshold": "--compression-ratio-threshold",
    "logprob_threshold": "--logprob-threshold",
    "no_speech_threshold": "--no-speech-threshold",
}


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(f"{item:g}" for item in value)
    return "none" if value is None else str(value)


def _whole_lines(path: Path) -> tuple[list[str], int]:
    """The lines of `path` that end in a newline (a last line cut short is left out), and
    the bytes they fill."""
    raw = path.read_bytes()
    kept = raw.rfind(b"\n") + 1
    lines = raw[:kept].decode("utf-8", errors="replace").split("\n")
    return [line for line in lines if line.strip()], kept


# -- one clip's rows ------------------------------------------------------------------------
class _Counted:
    """Audio pieces passed through, their samples counted (the clip's length)."""

    def __init__(self, pieces: Iterator[np.ndarray]):
        self.pieces, self.samples = pieces, 0

    def __iter__(self):
        for piece in self.pieces:
            self.samples += len(piece)
            yield piece


def _merged(segments: list[Segment]) -> list[tuple[float, float, str]]:
    """(start, end, text) of segments with text, one shorter than SHORTEST_ROW merged into the
    one before (or after, where it is first)."""
    timed: list[list] = []
    carried = ""
    for segment in segments:
        text = segment.text.strip()
        if not text:
            continue
        if segment.end - segment.start < SHORTEST_ROW:
            if timed:
                timed[-1][2] += " " + text
            else:
                carried = f"{carried} {text}".strip()
            continue
        timed.append([segment.start, segment.end, f"{carried} {text}".strip()])
        carried = ""
    if carried and timed:
        timed[-1][2] += " " + carried
    return [(start, end, text) for start, end, text in timed]


def clip_rows(
    clip: Clip, text: str, segments: list[Segment], seconds: float, *, timestamps: bool
) -> list[dict]:
    """The manifest rows of a clip the model transcribed as `text` / `segments` (times from
    the clip's start), `seconds` long; without the reference fields (`pseudo_label` adds
    them)."""
    offset = clip.start or 0.0
    timed = _merged(segments)
    if not timestamps and (seconds <= CHUNK_LENGTH or not timed):
        row = {"audio": clip.audio, "text": text}
        if clip.start is not None or clip.end is not None:
            end = clip.end if clip.end is not None else offset + seconds
            row |= {"start": round(offset, 3), "end": round(end, 3)}
        return [{**row, "duration": round(seconds, 3), "previous_text": clip.previous_text}]
    if not timestamps:  # a long recording: windows of at most 30 s, cut at segment times
        windows = pack_segments(clip.audio, timed, origin=clip.key)
        timed = [(w.start, w.end, w.text) for w in windows]
    rows, previous = [], clip.previous_text
    for start, end, window_text in timed:
        rows.append(
            {
                "audio": clip.audio,
                "text": window_text,
                "start": round(offset + start, 3),
                "end": round(offset + end, 3),
                "duration": round(end - start, 3),
                "previous_text": previous,
            }
        )
        previous = window_text
    return rows


def clip_wer(reference: str, hypothesis: str, language: str | None) -> float | None:
    """Word error rate of `hypothesis` against `reference`, normalised as `evaluate` does;
    None when the normalised reference has no words."""
    normalize = _normalizer(language)
    words, substitutions, deletions, insertions = word_counts(
        normalize(reference), normalize(hypothesis)
    )
    return None if words == 0 else (substitutions + deletions + insertions) / words


_NORMALIZERS: dict[str, object] = {}


def _normalizer(language: str | None):
    name = "english" if language in (None, "en") else "basic"
    if name not in _NORMALIZERS:
        _NORMALIZERS[name] = get_normalizer(name)
    return _NORMALIZERS[name]


# -- the library entry point ----------------------------------------------------------------
def pseudo_label(
    model,
    data: str | os.PathLike,
    output: str | os.PathLike,
    *,
    data_format: str | None = None,
    language: str | None = None,
    task: str | None = None,
    beam_size: int = 1,
    decoding: DecodingOptions | None = None,
    timestamps: bool = False,
    max_wer: float | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> PseudoLabelResult:
    """Label every clip of `data` with `model` (a `--model` spec, or a (model, processor)
    pair) into the manifest `output`, continuing an earlier run's (module docstring)."""
    output = Path(output)
    if beam_size < 1:
        raise UserError(f"--beam-size {beam_size}: must be at least 1")
    if max_wer is not None and not max_wer >= 0:
        raise UserError(f"--max-wer {max_wer}: expected a WER of 0 or more (0.1 is 10%)")
    check_output_path(output, "--output", folder=False)
    if output.suffix.lower() != ".jsonl":
        raise UserError(f"--output {output}: the labels are a JSONL manifest; name it FILE.jsonl")
    clips = collect_clips(data, data_format)
    if max_wer is not None and all(clip.reference is None for clip in clips):
        raise UserError(
            f"--max-wer {max_wer:g}: {data} has no transcripts to compare the model's with; "
            "drop --max-wer, or pass data with a text column or subtitles"
        )
    decoding = DecodingOptions() if decoding is None else decoding
    settings = Settings(
        model=str(model) if not isinstance(model, tuple) else _in_memory_name(model),
        language=language,
        task=task,
        beam_size=beam_size,
        timestamps=timestamps,
        max_wer=max_wer,
        temperatures=list(decoding.temperatures),
        compression_ratio_threshold=decoding.compression_ratio_threshold,
        logprob_threshold=decoding.logprob_threshold,
        no_speech_threshold=decoding.no_speech_threshold,
    )
    record = Progress(output, settings, overwrite=overwrite)
    try:
        todo = [clip for clip in clips if clip.key not in record.done]
        result = PseudoLabelResult(
            output, record.path, clips=len(clips), already_done=len(clips) - len(todo)
        )
        if result.already_done:
            tqdm.write(
                f"{output}: {result.already_done} of {len(clips)} clips already labelled "
                f"(by {settings.model}); "
                + (f"labelling the other {len(todo)}" if todo else "nothing left to label")
            )
        if todo:
            backend = load_backend(
                model, language=language, task=task, beam_size=beam_size, decoding=decoding
            )
            _label(backend, todo, record, result, progress=progress)
    finally:
        record.close()
    return result


def _in_memory_name(model) -> str:
    return str(getattr(model[0].config, "_name_or_path", "") or "a model in memory")


def _label(backend, clips: list[Clip], record: Progress, result, *, progress: bool) -> None:
    """Decode each clip, write its rows and record it; unreadable clips are left out."""
    settings = record.settings
    bar = tqdm(
        total=result.clips,
        initial=result.already_done,
        desc="pseudo-label",
        unit="clip",
        disable=not (progress and progress_bars_wanted()),
    )
    began = time.perf_counter()
    with bar:
        for clip in clips:
            pieces = _Counted(
                audio_pieces(clip.audio, PIECE_SECONDS, start=clip.start, end=clip.end)
            )
            try:
                text, segments = transcribe_in_pieces(backend.transcribe, pieces)
            except AudioError as exc:
                result.skipped.append((clip.audio, exc.reason))
                bar.update(1)
                continue
            seconds = pieces.samples / SAMPLE_RATE
            result.audio_seconds += seconds
            rows, outcome = _rows_and_outcome(clip, text.strip(), segments, seconds, settings)
            result.compared += clip.reference is not None
            result.over_max_wer += outcome == OVER_MAX_WER
            result.no_speech += outcome == NO_SPEECH
            result.labelled += outcome == WRITTEN
            result.rows += len(rows)
            record.record(clip, rows, outcome)
            bar.update(1)
    result.seconds = time.perf_counter() - began


def _rows_and_outcome(
    clip: Clip, text: str, segments: list[Segment], seconds: float, settings: Settings
) -> tuple[list[dict], str]:
    language = settings.language or clip.language
    wer = None if clip.reference is None else clip_wer(clip.reference, text, language)
    if not text:
        return [], NO_SPEECH
    # An empty reference (nobody speaks) against words: as far over any limit as it gets.
    over = wer is None or (settings.max_wer is not None and wer > settings.max_wer)
    if settings.max_wer is not None and clip.reference is not None and over:
        return [], OVER_MAX_WER
    rows = clip_rows(clip, text, segments, seconds, timestamps=settings.timestamps)
    extra = {"language": language} if language else {}
    if clip.reference is not None:
        extra |= {"reference_text": clip.reference, "wer": None if wer is None else round(wer, 4)}
    written = []
    for row in rows:
        row = {**row, **extra}
        written.append({key: value for key, value in row.items() if value is not None})
    return written, WRITTEN


def skipped_line(skipped: list[tuple[str, str]], shown: int = 3) -> str:
    """One line naming the clips left out as unreadable (the first `shown`, then a count)."""
    named = "; ".join(f"{audio} ({why})" for audio, why in skipped[:shown])
    more = f"; and {len(skipped) - shown} more" if len(skipped) > shown else ""
    return (
        f"skipped {len(skipped)} unreadable clip(s), not written (a rerun tries them again): "
        f"{named}{more}"
    )


__all__ = ["Clip", "PseudoLabelResult", "collect_clips", "pseudo_label", "skipped_line"]
