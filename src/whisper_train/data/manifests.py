"""Manifest files → examples: UTF-8 text, CSV/TSV/JSONL rows read one at a time, the column
names accepted for audio, text and language, and one `Example` per row (with optional timing).

The other layouts read their files with these too (`layouts`, `subtitles`, `hf_datasets`). A
mistake in a file is a `UserError` of one line naming the file and row, and the remedy.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from whisper_train.data.examples import Example
from whisper_train.errors import UserError

AUDIO_COLUMNS = ("audio", "audio_filepath", "path", "file_name")
TEXT_COLUMNS = ("transcription", "text", "sentence", "normalized_text")
LANGUAGE_COLUMNS = ("language", "locale")
# What was said just before the row's audio (`Example.previous_text`, --prompt-probability).
PROMPT_COLUMNS = ("previous_text", "prompt")


# -- reading text files ---------------------------------------------------------------------
def read_text(path: Path) -> str:
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


def read_rows(path: Path, delimiter: str | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) pairs of a CSV/TSV (delimiter given) or JSONL (None) file, one at a
    time: a corpus of a million rows is never held as a million dicts."""
    text = read_text(path)
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


def pick_column(path: Path, columns: Iterable[str], accepted: Sequence[str], what: str) -> str:
    columns = list(columns)
    for name in accepted:
        if name in columns:
            return name
    raise UserError(
        f"{path}: no {what} column; found {', '.join(map(str, columns)) or 'none'}; "
        f"accepted names: {', '.join(accepted)}"
    )


def seconds_field(path: Path, line: int, name: str, value: Any) -> float | None:
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(
            f"{path}:{line}: malformed row: {name} {value!r} is not a number of seconds"
        ) from None


def resolve_path(folder: str, audio: str) -> str:
    """An absolute path; a relative one is taken relative to the folder of the data file.

    String operations, not pathlib: this runs once per row, and pathlib objects cost four
    times as much for the same result."""
    if audio.startswith("~"):
        audio = os.path.expanduser(audio)
    return os.path.abspath(os.path.join(folder, audio))


# -- manifests ------------------------------------------------------------------------------
def manifest_examples(
    path: Path, rows: Iterable[tuple[int, dict[str, Any]]], audio_columns: Sequence[str]
) -> list[Example]:
    """Rows with an audio column, a text column and optional timing/language columns.

    The audio and text columns are those of the first row (a CSV's header); every row must
    have them. A language may be given on some rows only."""
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        return []
    audio_column = pick_column(path, first[1], audio_columns, "audio")
    text_column = pick_column(path, first[1], TEXT_COLUMNS, "text")
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
        duration = seconds_field(path, line, "duration", row.get("duration"))
        offset = seconds_field(path, line, "offset", row.get("offset"))
        start = seconds_field(path, line, "start", row.get("start"))
        end = seconds_field(path, line, "end", row.get("end"))
        if offset is not None:  # NeMo: offset + duration describe a window of the file
            start = offset
            end = offset + duration if duration is not None else end
        if start is not None and end is not None:
            if end <= start:
                raise UserError(
                    f"{path}:{line}: malformed row: end {end} is not after start {start}"
                )
            duration = end - start
        language = previous_text = None
        for column in LANGUAGE_COLUMNS:  # a loop, not next(genexpr): this runs once per row
            language = language or row.get(column)
        for column in PROMPT_COLUMNS:
            previous_text = previous_text or row.get(column)
        if previous_text is not None and not isinstance(previous_text, str):
            raise UserError(
                f"{path}:{line}: malformed row: the previous text must be text, got "
                f"{previous_text!r}"
            )
        examples.append(
            Example(
                audio=resolve_path(folder, audio.strip()),
                text=text.strip(),
                language=language or None,
                start=start,
                end=end,
                duration=duration,
                origin=f"{path}:{line}",
                previous_text=previous_text.strip() if previous_text else None,
            )
        )
    return examples


def _delimiter(path: Path) -> str | None:
    return {".csv": ",", ".tsv": "\t"}.get(path.suffix.lower())  # else JSONL


def read_manifest(path: Path) -> list[Example]:
    return manifest_examples(path, read_rows(path, _delimiter(path)), AUDIO_COLUMNS)


def is_manifest(suffixes: tuple[str, ...]) -> Callable[[Path], bool]:
    return lambda path: path.is_file() and path.suffix.lower() in suffixes
