"""Training data in any common layout → a flat list of `Example`s.

Layouts (name: what is detected):
    audiofolder   a folder with metadata.csv / metadata.jsonl (`file_name` + a text column)
    jsonl/csv/tsv a manifest file, one utterance per row (NeMo, HF, Coqui and similar columns)
    commonvoice   a Common Voice release folder (train.tsv, dev.tsv, test.tsv + clips/); DIR:dev
    kaldi         a Kaldi data folder (wav.scp, text, optional segments)
    hf            a `datasets` dataset saved with save_to_disk (DIR or DIR:split), or a hub id
                  name:config:split when nothing local matches
    subtitles     a folder of long recordings with .srt/.vtt files of the same stem, or a manifest
                  whose rows are timed segments of long recordings; consecutive segments are
                  packed into windows of at most 30 s

Every reader is a small function; `LAYOUTS` maps each format name to its detector and reader,
in detection order. A mistake in the data is a `UserError` of one line naming the file (and
row) and the remedy.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import os
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from whisper_train import runfolder
from whisper_train.audio import (
    AUDIO_SUFFIXES,
    CHUNK_LENGTH,
)
from whisper_train.data.examples import Example
from whisper_train.errors import AudioError, UserError

AUDIO_COLUMNS = ("audio", "audio_filepath", "path", "file_name")
TEXT_COLUMNS = ("transcription", "text", "sentence", "normalized_text")
LANGUAGE_COLUMNS = ("language", "locale")
SUBTITLE_SUFFIXES = (".srt", ".vtt")
COMMONVOICE_SPLITS = ("train", "dev", "test", "validated", "other", "invalidated")
DATASETS_EXTRA = "pip install 'whisper-train[datasets]'"
# Subtitle cues may touch; a millisecond of overlap is rounding in the file, not a mistake.
OVERLAP_TOLERANCE = 1e-3


# -- reading text files ---------------------------------------------------------------------
def _read_text(path: Path) -> str:
    """A whole text file as UTF-8 (a BOM is dropped); non-UTF-8 bytes are a UserError."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise UserError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); re-save the file "
            "as UTF-8"
        ) from None


def _read_rows(path: Path, delimiter: str | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) pairs of a CSV/TSV (delimiter given) or JSONL (None) file, one at a
    time: a corpus of a million rows is never held as a million dicts."""
    text = _read_text(path)
    if delimiter is None:
        return _jsonl_rows(path, text)
    return _delimited_rows(path, text, delimiter)


def _delimited_rows(path: Path, text: str, delimiter: str) -> Iterator[tuple[int, dict[str, Any]]]:
    # Tab-separated files (Common Voice among them) do not quote fields: a `"` is text.
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter, quoting=quoting)
    for row in reader:
        # A short row fills missing fields with None; a long one stores the extras under None.
        extras = row.pop(None, None) or []
        missing = list(row.values()).count(None)
        if extras or missing:
            expected = len(reader.fieldnames or [])
            remedy = "text must not contain tabs" if delimiter == "\t" else 'quote fields with ","'
            raise UserError(
                f"{path}:{reader.line_num}: malformed row: {expected - missing + len(extras)} "
                f"fields where the header has {expected}; fix the row ({remedy})"
            )
        yield reader.line_num, row


def _jsonl_rows(path: Path, text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    # Lines end at "\n" only: JSON strings may hold U+2028 and other characters that
    # str.splitlines would cut at.
    begin, number = 0, 0
    while begin < len(text):
        end = text.find("\n", begin)
        end = len(text) if end < 0 else end
        line, begin, number = text[begin:end], end + 1, number + 1
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{path}:{number}: malformed row: not valid JSON ({exc.msg}); one JSON object "
                "per line"
            ) from None
        if not isinstance(row, dict):
            raise UserError(
                f"{path}:{number}: malformed row: expected a JSON object, got "
                f"{type(row).__name__}; one JSON object per line"
            )
        yield number, row


def _pick_column(path: Path, columns: Iterable[str], accepted: Sequence[str], what: str) -> str:
    columns = list(columns)
    for name in accepted:
        if name in columns:
            return name
    raise UserError(
        f"{path}: no {what} column; found {', '.join(map(str, columns)) or 'none'}; "
        f"accepted names: {', '.join(accepted)}"
    )


def _number(path: Path, line: int, name: str, value: Any) -> float | None:
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(
            f"{path}:{line}: malformed row: {name} {value!r} is not a number of seconds"
        ) from None


def _resolve(folder: str, audio: str) -> str:
    """An absolute path; a relative one is taken relative to the folder of the data file.

    String operations, not pathlib: this runs once per row, and pathlib objects cost four
    times as much for the same result."""
    if audio.startswith("~"):
        audio = os.path.expanduser(audio)
    return os.path.abspath(os.path.join(folder, audio))


# -- manifests and audiofolder --------------------------------------------------------------
def _manifest_examples(
    path: Path, rows: Iterable[tuple[int, dict[str, Any]]], audio_columns: Sequence[str]
) -> list[Example]:
    """Rows with an audio column, a text column and optional timing/language columns.

    The audio and text columns are those of the first row (a CSV's header); every row must
    have them. A language may be given on some rows only."""
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        return []
    audio_column = _pick_column(path, first[1], audio_columns, "audio")
    text_column = _pick_column(path, first[1], TEXT_COLUMNS, "text")
    folder = os.fspath(path.parent)
    examples = []
    for line, row in itertools.chain([first], rows):
        audio = row.get(audio_column)
        if isinstance(audio, dict):  # HF-style {"path": ...}
            audio = audio.get("path")
        if not isinstance(audio, str) or not audio.strip():
            raise UserError(
                f"{path}:{line}: malformed row: no audio path in column '{audio_column}'"
            )
        text = row.get(text_column)
        if not isinstance(text, str):
            raise UserError(
                f"{path}:{line}: malformed row: column '{text_column}' must be text, got {text!r}"
            )
        duration = _number(path, line, "duration", row.get("duration"))
        offset = _number(path, line, "offset", row.get("offset"))
        start = _number(path, line, "start", row.get("start"))
        end = _number(path, line, "end", row.get("end"))
        if offset is not None:  # NeMo: offset + duration describe a window of the file
            start = offset
            end = offset + duration if duration is not None else end
        if start is not None and end is not None:
            if end <= start:
                raise UserError(
                    f"{path}:{line}: malformed row: end {end} is not after start {start}"
                )
            duration = end - start
        language = None
        for column in LANGUAGE_COLUMNS:  # a loop, not next(genexpr): this runs once per row
            language = language or row.get(column)
        examples.append(
            Example(
                audio=_resolve(folder, audio.strip()),
                text=text.strip(),
                language=language or None,
                start=start,
                end=end,
                duration=duration,
                origin=f"{path}:{line}",
            )
        )
    return examples


def _delimiter(path: Path) -> str | None:
    return {".csv": ",", ".tsv": "\t"}.get(path.suffix.lower())  # else JSONL


def _read_manifest(path: Path) -> list[Example]:
    return _manifest_examples(path, _read_rows(path, _delimiter(path)), AUDIO_COLUMNS)


def _is_manifest(suffixes: tuple[str, ...]) -> Callable[[Path], bool]:
    return lambda path: path.is_file() and path.suffix.lower() in suffixes


def _audiofolder_metadata(folder: Path) -> Path | None:
    for name in ("metadata.csv", "metadata.jsonl"):
        if (folder / name).is_file():
            return folder / name
    return None


def _detect_audiofolder(path: Path) -> bool:
    return path.is_dir() and _audiofolder_metadata(path) is not None


def _read_audiofolder(folder: Path) -> list[Example]:
    metadata = _audiofolder_metadata(folder)
    if metadata is None:
        raise UserError(f"{folder}: no metadata.csv or metadata.jsonl; add one (file_name,text)")
    rows = _read_rows(metadata, "," if metadata.suffix == ".csv" else None)
    return _manifest_examples(metadata, rows, ("file_name",))


# -- Common Voice ---------------------------------------------------------------------------
def _commonvoice_tsv(folder: Path, split: str | None) -> Path:
    name = split or "train"
    tsv = folder / f"{name}.tsv"
    if not tsv.is_file():
        found = sorted(p.stem for p in folder.glob("*.tsv"))
        raise UserError(
            f"{folder}: no {name}.tsv in this Common Voice folder; splits found: "
            f"{', '.join(found) or 'none'} (choose one as {folder}:SPLIT)"
        )
    return tsv


def _detect_commonvoice(path: Path) -> bool:
    if path.is_file():  # e.g. cv-corpus/en/dev.tsv
        return path.suffix == ".tsv" and (path.parent / "clips").is_dir()
    return (path / "clips").is_dir() and any(
        (path / f"{name}.tsv").is_file() for name in COMMONVOICE_SPLITS
    )


def _read_commonvoice(path: Path, split: str | None = None) -> list[Example]:
    tsv = path if path.is_file() else _commonvoice_tsv(path, split)
    # `path` names a file in clips/ beside the TSV.
    rows = (
        (line, {**row, "path": f"clips/{row['path']}"} if row.get("path") else row)
        for line, row in _read_rows(tsv, "\t")
    )
    return _manifest_examples(tsv, rows, ("path",))


# -- Kaldi ----------------------------------------------------------------------------------
def _kaldi_table(path: Path) -> list[tuple[int, str, str]]:
    """(line, key, rest) for each non-empty line of a Kaldi table file."""
    entries = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        key, _, rest = line.strip().partition(" ")
        entries.append((number, key, rest.strip()))
    return entries


def _detect_kaldi(path: Path) -> bool:
    return path.is_dir() and (path / "wav.scp").is_file() and (path / "text").is_file()


def _read_kaldi(folder: Path) -> list[Example]:
    for name in ("wav.scp", "text"):
        if not (folder / name).is_file():
            raise UserError(f"{folder}: no {name}; a Kaldi data folder needs wav.scp and text")
    # Kaldi recipes write wav.scp paths relative to the recipe root, two levels above
    # data/<set>; take the first of these folders where the first file exists.
    recordings: dict[str, str] = {}
    for line, key, target in _kaldi_table(folder / "wav.scp"):
        if target.endswith("|") or not target:
            raise UserError(
                f"{folder / 'wav.scp'}:{line}: '{key}' is a piped command or empty; convert the "
                "audio to files (e.g. with sox) and list plain paths in wav.scp"
            )
        recordings[key] = target
    roots = [folder, folder.parent, folder.parent.parent, Path.cwd()]
    first = next(iter(recordings.values()), "")
    root = next((r for r in roots if (r / first).exists()), folder)
    texts = {key: (line, text) for line, key, text in _kaldi_table(folder / "text")}

    def example(utterance: str, recording: str, **window: float) -> Example:
        line, text = texts[utterance]
        if recording not in recordings:
            raise UserError(
                f"{folder}: recording '{recording}' of utterance '{utterance}' is not in "
                "wav.scp; add it or remove the utterance"
            )
        return Example(
            audio=_resolve(os.fspath(root), recordings[recording]),
            text=text,
            origin=f"{folder / 'text'}:{line}",
            **window,
        )

    segments_file = folder / "segments"
    if not segments_file.is_file():
        return [example(key, key) for key in texts]
    examples = []
    for line, key, rest in _kaldi_table(segments_file):
        fields = rest.split()
        if len(fields) != 3:
            raise UserError(f"{segments_file}:{line}: malformed row: expected 'utt rec start end'")
        if key not in texts:
            continue  # Kaldi's fix_data_dir convention: segments without text are dropped
        start = _number(segments_file, line, "start", fields[1]) or 0.0
        end = _number(segments_file, line, "end", fields[2]) or 0.0
        examples.append(example(key, fields[0], start=start, end=end, duration=end - start))
    return examples


# -- Hugging Face datasets ------------------------------------------------------------------
def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"reading Hugging Face datasets needs the `datasets` package: {DATASETS_EXTRA}"
        ) from None
    return datasets


def _detect_hf(path: Path) -> bool:
    return path.is_dir() and any(
        (path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def _read_hf_disk(path: Path, split: str | None = None) -> list[Example]:
    datasets = _import_datasets()
    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"{path}: not a dataset saved with save_to_disk ({reason[:200]}); save it with "
            "Dataset.save_to_disk or pick another --data-format"
        ) from None
    if isinstance(dataset, datasets.DatasetDict):
        name = split or "train"
        if name not in dataset:
            raise UserError(
                f"{path}: no split '{name}'; splits found: {', '.join(dataset)} (choose one as "
                f"{path}:SPLIT)"
            )
        dataset = dataset[name]
    return _hf_examples(dataset, str(path), _cache_dir() / dataset._fingerprint)


def _read_hf_hub(dataset_id: str) -> list[Example]:
    """`name`, `name:config` or `name:config:split` (default split: train) from the hub."""
    datasets = _import_datasets()
    name, config, split = ([*dataset_id.split(":"), None, None])[:3]
    try:
        dataset = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as exc:  # noqa: BLE001 - any failure here means "not loadable", one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"{dataset_id}: not a local file or folder, and loading it as a Hugging Face hub "
            f"dataset (name:config:split) failed: {reason[:200]}; check the path or id"
        ) from None
    return _hf_examples(dataset, dataset_id, _cache_dir() / dataset._fingerprint)


def _cache_dir() -> Path:
    """Where audio bytes from datasets are stored as files (`_cached_audio`)."""
    return runfolder.user_cache_dir("hf-audio")


def _hf_examples(dataset: Any, origin: str, cache: Path) -> list[Example]:
    datasets = _import_datasets()
    columns = list(dataset.column_names)
    audio_column = _pick_column(Path(origin), columns, AUDIO_COLUMNS, "audio")
    text_column = _pick_column(Path(origin), columns, TEXT_COLUMNS, "text")
    language_column = next((c for c in LANGUAGE_COLUMNS if c in columns), None)
    if isinstance(dataset.features[audio_column], datasets.Audio):
        # Decoding in `datasets` needs torchcodec; read the stored bytes/paths instead.
        dataset = dataset.cast_column(audio_column, datasets.Audio(decode=False))
    examples = []
    for index, row in enumerate(dataset):
        audio = row[audio_column]
        where = f"{origin}[{index}]"
        if isinstance(audio, dict) and audio.get("bytes"):
            path = _cached_audio(audio["bytes"], cache, where)
        elif isinstance(audio, dict) and audio.get("path"):
            path = os.path.abspath(audio["path"])
        elif isinstance(audio, str):
            path = os.path.abspath(audio)
        else:
            raise UserError(f"{where}: malformed row: no audio bytes or path in '{audio_column}'")
        language = row.get(language_column) if language_column else None
        examples.append(
            Example(
                audio=path,
                text=str(row[text_column] or "").strip(),
                language=language or None,
                origin=where,
            )
        )
    return examples


def _cached_audio(data: bytes, cache: Path, where: str) -> str:
    """Store encoded audio bytes once, unchanged, as `cache/<sha1>.<format>`; return that path.

    The bytes are checked to be audio soundfile or PyAV reads, and kept as they are: a FLAC
    stays a FLAC (decoding to float32 WAV made 11 MB of FLAC 43 MB on disk), an M4A an M4A.
    `--streaming` reads a hub dataset without any copy."""
    from whisper_train.audio import read_header

    try:
        # "FLAC/PCM_16", "WAV/GSM610", "MPEG/MPEG_LAYER_III" (soundfile) or FFmpeg's
        # "mov,mp4,m4a,3gp,3g2,mj2/aac", "matroska,webm/opus" (PyAV)
        container = read_header(data, origin=where).format.split("/")[0].split(",")[0].lower()
    except AudioError as exc:
        raise AudioError(where, f"cannot decode the audio bytes ({exc.reason})") from None
    suffix = {"mpeg": "mp3", "wavex": "wav", "mov": "m4a", "matroska": "webm"}.get(
        container, container
    )
    target = cache / f"{hashlib.sha1(data).hexdigest()}.{suffix}"
    if not target.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        partial.write_bytes(data)
        os.replace(partial, target)  # atomic: a parallel reader never sees half a file
    return str(target)


# -- subtitles ------------------------------------------------------------------------------
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
    lines = _read_text(path).splitlines()
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
    to its last segment's end; its `segments` are relative to the window start. A segment longer
    than `max_seconds` becomes a window of its own, which screening then reports as too long.
    """
    windows: list[list[tuple[float, float, str]]] = []
    for segment in sorted(segments):
        if windows and segment[1] - windows[-1][0][0] <= max_seconds:
            windows[-1].append(segment)
        else:
            windows.append([segment])
    examples = []
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
            )
        )
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


def _detect_subtitles(path: Path) -> bool:
    return path.is_dir() and any(p.suffix.lower() in SUBTITLE_SUFFIXES for p in path.iterdir())


def _read_subtitles(path: Path) -> list[Example]:
    if path.is_file():  # a manifest of timed segments: group the rows by recording
        return _group_manifest_segments(path, _read_manifest(path))
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


# -- the registry ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """A data layout: how to recognise it, how to read it, and what the detector looks for."""

    name: str
    detect: Callable[[Path], bool]
    read: Callable[..., list[Example]]
    looks_for: str
    has_splits: bool = False  # accepts PATH:SPLIT


# In detection order: folder layouts with a distinctive file first, plain manifests last.
LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout(
            "audiofolder", _detect_audiofolder, _read_audiofolder, "metadata.csv or metadata.jsonl"
        ),
        Layout(
            "commonvoice",
            _detect_commonvoice,
            _read_commonvoice,
            "clips/ with train.tsv/dev.tsv/test.tsv",
            has_splits=True,
        ),
        Layout("kaldi", _detect_kaldi, _read_kaldi, "wav.scp and text"),
        Layout(
            "hf",
            _detect_hf,
            _read_hf_disk,
            "dataset_info.json/state.json/dataset_dict.json (save_to_disk)",
            has_splits=True,
        ),
        Layout(
            "subtitles",
            _detect_subtitles,
            _read_subtitles,
            "audio files with .srt/.vtt of the same name",
        ),
        Layout("jsonl", _is_manifest((".jsonl", ".json")), _read_manifest, "a .jsonl file"),
        Layout("csv", _is_manifest((".csv",)), _read_manifest, "a .csv file"),
        Layout("tsv", _is_manifest((".tsv",)), _read_manifest, "a .tsv file"),
    )
}

# A hub id: `name` or `owner/name`, optionally `:config` and `:split`.
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?(:[\w.-]*){0,2}$")


def _split_suffix(path: str) -> tuple[Path, str | None]:
    """`DIR:dev` → (DIR, "dev") when DIR exists and `DIR:dev` does not."""
    if not os.path.exists(path) and ":" in path:
        base, _, split = path.rpartition(":")
        if base and os.path.exists(base) and split and "/" not in split:
            return Path(base), split
    return Path(path), None


def load_examples(path: str | os.PathLike, *, data_format: str | None = None) -> list[Example]:
    """Read every example of the data at `path`, detecting its layout unless `data_format`.

    `path` may carry a split (`DIR:dev`) for Common Voice and saved HF DatasetDicts. A string
    that is no local path is tried as a hub dataset id `name:config:split`. Raises UserError
    for a missing path, an unrecognised layout, bad rows, and data with no examples.
    """
    if data_format is not None and data_format not in LAYOUTS:
        raise UserError(
            f"--data-format {data_format}: unknown format; choose one of {', '.join(LAYOUTS)}"
        )
    location, split = _split_suffix(str(path))
    if not location.exists():
        text = str(path)
        if (
            data_format in (None, "hf")
            and _HUB_ID.match(text)
            and not text.endswith((".jsonl", ".json", ".csv", ".tsv"))
        ):
            return _non_empty(text, _read_hf_hub(text))
        raise UserError(f"{path}: no such file or folder; check the path")

    if data_format is not None:
        layout = LAYOUTS[data_format]
    else:
        layout = next((lay for lay in LAYOUTS.values() if lay.detect(location)), None)
        if layout is None:
            looked_for = "; ".join(f"{lay.name}: {lay.looks_for}" for lay in LAYOUTS.values())
            raise UserError(
                f"{path}: no recognised data layout (looked for {looked_for}); rename the "
                f"files to match one, or pass --data-format ({', '.join(LAYOUTS)})"
            )
    if split is not None and not layout.has_splits:
        raise UserError(
            f"{path}: ':{split}' selects a split, which the {layout.name} layout has "
            "not; drop the suffix"
        )
    if layout.name in ("jsonl", "csv", "tsv") and not location.is_file():
        raise UserError(f"{path}: the {layout.name} format needs a manifest file, not a folder")
    examples = layout.read(location, split) if layout.has_splits else layout.read(location)
    _check_some_audio_exists(str(path), examples)
    return _non_empty(str(path), examples)


def _non_empty(path: str, examples: list[Example]) -> list[Example]:
    if not examples:
        raise UserError(f"{path}: no examples found; add rows (audio + text) to the data")
    return examples


def _check_some_audio_exists(path: str, examples: list[Example]) -> None:
    """All audio missing means the paths are resolved against the wrong folder: say so now.

    Some missing files are left to `screen_examples`, which skips and counts them.
    """
    if examples and not any(os.path.isfile(example.audio) for example in examples):
        first = examples[0]
        raise UserError(
            f"{first.origin}: audio file {first.audio} not found, nor any other of the "
            f"{len(examples)} audio files in {path}; relative paths are resolved against the "
            "data file's folder"
        )


__all__ = [
    "AUDIO_COLUMNS",
    "TEXT_COLUMNS",
    "LAYOUTS",
    "Layout",
    "load_examples",
    "pack_segments",
    "parse_subtitles",
    "OVERLAP_TOLERANCE",
]
