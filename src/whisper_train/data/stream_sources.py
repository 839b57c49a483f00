"""Stream sources: what a streamed `--data` names, opening it with `datasets`, and its rows.

    --data shards/                           a folder of WebDataset .tar shards (KEY.flac + KEY.txt
                                             or KEY.json with `text` and optional `language`)
    --data 'shards/train-{000000..000099}.tar'  the same, named by a brace pattern (or a glob)
    --data parquet/                          a folder of Parquet files in the Hugging Face audio
                                             layout (an `audio` column of {bytes, path} + a text
                                             column)
    --data name:config:split --streaming     a hub dataset, streamed instead of downloaded
    --data cuts.jsonl.gz --streaming         a lhotse CutSet manifest (or DIR[:NAME] of them),
                                             its cuts read lazily and decoded in the workers

`stream_source` turns `--data` into a `StreamSource` (shard files from a folder, a brace pattern
or a glob, local or remote, or a hub id); `open_stream` opens it as a `datasets.IterableDataset`
whose audio stays encoded, with the `Columns` that hold audio, text and language; `read_row`,
`decode_audio` and `audio_header` read one row in memory; `count_rows` counts the rows of one
process's share without decoding them. The stream training iterates is `streaming`'s.
"""

from __future__ import annotations

import glob
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from whisper_train.audio import AUDIO_SUFFIXES, AudioHeader, load_audio, read_header
from whisper_train.data.layouts import (
    AUDIO_COLUMNS,
    DATASETS_EXTRA,
    HUB_DATASET_ID,
    LANGUAGE_COLUMNS,
    LAYOUTS,
    TEXT_COLUMNS,
)
from whisper_train.data.lhotse_cuts import (
    cut_manifest,
    detect_cuts,
    stream_parts,
    stream_rows,
)
from whisper_train.errors import AudioError, UserError

STREAM_FORMATS = ("webdataset", "parquet")
SHARD_SUFFIXES = {".tar": "webdataset", ".parquet": "parquet"}
# WebDataset names a sample's fields by extension: these hold the audio (every format a folder
# of files may hold: M4A from phones, WebM from browsers...).
WEBDATASET_AUDIO = tuple(suffix.lstrip(".") for suffix in AUDIO_SUFFIXES)
# The audio column as raw bytes and path. `datasets` 5 types audio as `Audio`, whose every
# encode imports torchcodec (even with decode=False); a plain struct needs nothing.
RAW_AUDIO = {"bytes": "binary", "path": "string"}
_BRACE = re.compile(r"\{([^{}]*)\}")


# -- what --data names ----------------------------------------------------------------------
@dataclass(frozen=True)
class StreamSource:
    """A stream `--data` names: shard files of one format, or a hub dataset."""

    spec: str  # as the user wrote it, for messages
    kind: str  # "webdataset", "parquet", "hub" or "lhotse"
    # shard files (or URLs), in order; the cut manifest for lhotse; empty for a hub dataset
    files: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind == "hub":
            return f"hub dataset {self.spec} (streamed)"
        if self.kind == "lhotse":
            return f"lhotse cuts {self.files[0]} (read lazily)"
        return f"{len(self.files)} {self.kind} shard{'s' if len(self.files) != 1 else ''}"


def expand_braces(pattern: str) -> list[str]:
    """`train-{000..002}.tar` → train-000.tar, train-001.tar, train-002.tar; `{a,b}` lists too
    (the WebDataset convention for naming shards)."""
    for match in _BRACE.finditer(pattern):
        body = match.group(1)
        numbers = re.fullmatch(r"(\d+)\.\.(\d+)", body)
        if numbers:
            low, high = numbers.groups()
            width = len(low) if low.startswith("0") else 0
            items = [str(i).zfill(width) for i in range(int(low), int(high) + 1)]
        elif "," in body:
            items = body.split(",")
        else:
            continue  # a literal brace
        head, tail = pattern[: match.start()], pattern[match.end() :]
        return [name for item in items for name in expand_braces(head + item + tail)]
    return [pattern]


def stream_source(
    spec: str | os.PathLike | None, *, data_format: str | None = None, streaming: bool = False
) -> StreamSource | None:
    """The stream `spec` names, or None for data read whole (`whisper_train.data` layouts).

    Shards (a folder of .tar or .parquet files, one such file, a brace pattern or a glob) are
    always a stream; a hub id is one with `streaming`. UserError for a pattern that names no
    file, a folder mixing both formats, and `streaming` on data that cannot stream.
    """
    if spec is None:
        return None
    text = str(spec)
    if data_format is not None and data_format not in STREAM_FORMATS and not streaming:
        return None
    if streaming and data_format in (None, "lhotse"):
        manifest = _streamed_cuts(text)
        if manifest is not None:
            return StreamSource(text, "lhotse", (manifest,))
    files = _shard_files(text, data_format)
    if files:
        kinds = {data_format} if data_format in STREAM_FORMATS else _kinds(files)
        if len(kinds) != 1:
            raise UserError(
                f"--data {text}: holds both WebDataset (.tar) and Parquet shards; point --data at "
                "one format (a brace pattern or a glob selects files)"
            )
        return StreamSource(text, kinds.pop(), tuple(files))
    if data_format in STREAM_FORMATS:
        raise UserError(
            f"--data {text}: no {data_format} shards found (looked for "
            f"{'.tar' if data_format == 'webdataset' else '.parquet'} files); check the path"
        )
    if not streaming:
        return None
    if not os.path.exists(text) and HUB_DATASET_ID.match(text):
        return StreamSource(text, "hub")
    raise UserError(
        f"--data {text} --streaming: only WebDataset or Parquet shards, lhotse cuts and hub ids "
        "stream; drop --streaming to read this data whole"
    )


def _streamed_cuts(text: str) -> str | None:
    """The cut manifest `text` names (a file, a folder of them, or FOLDER:NAME), else None."""
    path, split = Path(text), None
    if not path.exists() and ":" in text:
        base, _, split = text.rpartition(":")
        path = Path(base)
    if not path.exists() or not detect_cuts(path):
        return None
    return str(cut_manifest(path, split).resolve())


def _kinds(files: list[str]) -> set[str]:
    return {SHARD_SUFFIXES.get(Path(name.split("?")[0]).suffix.lower(), "") for name in files}


def _shard_files(text: str, data_format: str | None) -> list[str]:
    """The shard files `text` names; empty when it names none (or another layout)."""
    suffixes = tuple(
        s for s, kind in SHARD_SUFFIXES.items() if data_format in (None, kind, "hub")
    ) or tuple(SHARD_SUFFIXES)
    if "://" in text:  # a remote pattern: fsspec (through `datasets`) reads it
        names = expand_braces(text)
        return names if all(n.split("?")[0].endswith(suffixes) for n in names) else []
    if "{" in text or any(c in text for c in "*?["):
        names = [m for name in expand_braces(text) for m in sorted(glob.glob(name)) or [name]]
        if not any(name.endswith(suffixes) for name in names):
            return []
        missing = [name for name in names if not os.path.isfile(name)]
        if missing:
            raise UserError(
                f"--data {text}: {missing[0]} does not exist ({len(missing)} of {len(names)} "
                "shards missing); check the pattern"
            )
        return [os.path.abspath(name) for name in names]
    path = Path(text)
    if path.is_file():
        return [str(path.resolve())] if path.suffix.lower() in suffixes else []
    if not path.is_dir():
        return []
    if data_format is None and any(layout.detect(path) for layout in LAYOUTS.values()):
        return []  # a layout read whole (audiofolder, save_to_disk, ...) wins
    for folder in (path, path / "data"):  # the hub's Parquet layout keeps files in data/
        found = sorted(str(p.resolve()) for p in folder.glob("*") if p.suffix.lower() in suffixes)
        if found:
            return found
    return []


# -- opening a stream -----------------------------------------------------------------------
@dataclass(frozen=True)
class Columns:
    """Which columns of a stream hold what."""

    audio: tuple[str, ...]  # one per WebDataset audio extension; one for Parquet and hub data
    text: str | None  # a text column; None when the text is in `json`
    json: str | None = None  # WebDataset KEY.json: {"text": ..., "language": ...}
    language: str | None = None
    key: str | None = None  # WebDataset's sample key; lhotse's cut origin
    url: str | None = None  # WebDataset's shard name
    window: tuple[str, str] | None = None  # (start, end) s of the audio file (lhotse cuts)

    def wanted(self) -> list[str]:
        named = [*self.audio, self.text, self.json, self.language, self.key, self.url]
        named += list(self.window or ())
        return [c for c in named if c]


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"streaming --data needs the `datasets` package: {DATASETS_EXTRA}"
        ) from None
    return datasets


def open_stream(source: StreamSource):
    """(a `datasets.IterableDataset` of the source's rows, its `Columns`), audio left undecoded:
    rows hold {"bytes", "path"} that `decode_audio` reads in memory."""
    datasets = _import_datasets()
    if source.kind == "lhotse":
        return _open_cut_stream(source, datasets)
    try:
        if source.kind == "hub":
            name, config, split = ([*source.spec.split(":"), None, None])[:3]
            dataset = datasets.load_dataset(
                name, config or None, split=split or "train", streaming=True
            )
        else:
            dataset = datasets.load_dataset(
                source.kind, data_files={"train": list(source.files)}, split="train", streaming=True
            )
        if dataset.features is None:
            dataset = dataset._resolve_features()
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here means "not readable", one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        remedy = (
            "every sample needs the same fields, e.g. KEY.flac + KEY.txt"
            if source.kind == "webdataset"
            else "check the path or id"
        )
        raise UserError(
            f"--data {source.spec}: cannot read it ({reason[:200]}); {remedy}"
        ) from None
    columns = _columns(source, dataset.features)
    raw = datasets.Features({k: datasets.Value(v) for k, v in RAW_AUDIO.items()})
    for column in columns.audio:
        if isinstance(dataset.features[column], (datasets.Audio, dict)):
            dataset = dataset.cast_column(column, raw)
    return dataset.select_columns(columns.wanted()), columns


def _open_cut_stream(source: StreamSource, datasets):
    """A cut manifest as a `datasets` stream of its cuts' rows (`lhotse_cuts.stream_rows`),
    split into `stream_parts` parts that `datasets` deals out to processes and workers as it
    deals shards."""
    parts = stream_parts(Path(source.files[0]))  # in the main process: lhotse missing is one line
    string, seconds = datasets.Value("string"), datasets.Value("float64")
    features = datasets.Features(
        {"audio": string, "start": seconds, "end": seconds, "text": string}
        | {"language": string, "origin": string}
    )
    dataset = datasets.IterableDataset.from_generator(
        stream_rows,
        features=features,
        gen_kwargs={
            "manifest": source.files[0],
            "parts": list(range(parts)),
            "n_parts": parts,
        },
    )
    columns = Columns(
        ("audio",), "text", language="language", key="origin", window=("start", "end")
    )
    return dataset, columns


def _columns(source: StreamSource, features) -> Columns:
    names = list(features)
    where = f"--data {source.spec}"
    if source.kind == "webdataset":
        audio = tuple(c for c in names if c.rsplit(".", 1)[-1].lower() in WEBDATASET_AUDIO)
        text = next((c for c in names if c.lower() == "txt"), None)
        json_column = next((c for c in names if c.lower() == "json"), None)
        if not audio or not (text or json_column):
            raise UserError(
                f"{where}: WebDataset samples need an audio file ({', '.join(WEBDATASET_AUDIO)}) "
                f"and KEY.txt or KEY.json; found fields {', '.join(names)}"
            )
        return Columns(
            audio,
            text,
            json_column,
            key="__key__" if "__key__" in names else None,
            url="__url__" if "__url__" in names else None,
        )
    audio_column = next((c for c in AUDIO_COLUMNS if c in names), None)
    text = next((c for c in TEXT_COLUMNS if c in names), None)
    if audio_column is None or text is None:
        raise UserError(
            f"{where}: needs an audio column ({', '.join(AUDIO_COLUMNS)}) and a text column "
            f"({', '.join(TEXT_COLUMNS)}); found {', '.join(names)}"
        )
    language = next((c for c in LANGUAGE_COLUMNS if c in names), None)
    return Columns((audio_column,), text, language=language)


# -- one row → audio and text ---------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """What training needs from one stream row (audio still encoded)."""

    audio: Any  # {"bytes", "path"}, bytes, or a path
    text: str | None
    language: str | None
    origin: str  # shard:key or the audio's path, for messages
    start: float | None = None  # the window [start, end) s of the audio (lhotse cuts)
    end: float | None = None


def read_row(row: dict, columns: Columns, fallback_origin: str) -> Row:
    audio = next((row[c] for c in columns.audio if row.get(c) is not None), None)
    text, language = row.get(columns.text) if columns.text else None, None
    if columns.json and isinstance(row.get(columns.json), dict):
        meta = row[columns.json]
        text = (
            text if text is not None else next((meta[c] for c in TEXT_COLUMNS if c in meta), None)
        )
        language = next((meta[c] for c in LANGUAGE_COLUMNS if meta.get(c)), None)
    if columns.language:
        language = row.get(columns.language) or language
    if columns.key and row.get(columns.key):
        shard = Path(str(row.get(columns.url) or "")).name if columns.url else ""
        origin = f"{shard}:{row[columns.key]}" if shard else str(row[columns.key])
    elif isinstance(audio, dict) and audio.get("path"):
        origin = str(audio["path"])
    else:
        origin = fallback_origin
    start, end = (row.get(c) for c in columns.window) if columns.window else (None, None)
    return Row(audio, text if isinstance(text, str) else None, language or None, origin, start, end)


def decode_audio(
    audio: Any, origin: str, *, start: float | None = None, end: float | None = None
) -> np.ndarray:
    """Audio bytes (or a path; its window [start, end) s) → float32 mono at 16 kHz, decoded in
    memory by the readers a file goes through (soundfile, else PyAV: an M4A in a shard trains
    like one in a folder); AudioError naming `origin` when it does not decode or holds no
    samples."""
    # A plain path (a lhotse cut's recording) goes to load_audio as it is, which names a
    # missing file as such.
    source = audio if isinstance(audio, str) and start is not None else _row_audio(audio)
    if source is None:
        raise AudioError(origin, "no audio bytes in this sample")
    return load_audio(
        source, start=start, end=end, origin=origin if isinstance(source, bytes) else None
    )


def audio_header(audio: Any) -> AudioHeader | str:
    """The header of a row's audio (no decoding where the format states its length), or why
    there is none."""
    source = _row_audio(audio)
    if source is None:
        return "no audio bytes in this sample"
    try:
        return read_header(source)
    except AudioError as exc:
        return exc.reason


def _row_audio(audio: Any) -> bytes | str | None:
    """A row's audio cell ({"bytes", "path"}, bytes, or a path) → its bytes, else the path of
    an existing file, else None."""
    data = audio.get("bytes") if isinstance(audio, dict) else audio
    path = audio.get("path") if isinstance(audio, dict) else None
    if isinstance(data, str):
        data, path = None, data
    if data:
        return bytes(data)
    return path if path and os.path.isfile(path) else None


# -- counting a process's rows -----------------------------------------------------------------
def count_rows(source: StreamSource, *, rank: int = 0, world_size: int = 1) -> int:
    """Rows in process `rank`'s share of the stream (the sum over ranks is the whole), read
    without decoding: Parquet reads only the text column, WebDataset reads the tars through."""
    from datasets.distributed import split_dataset_by_node

    dataset, columns = open_stream(source)
    dataset = dataset.select_columns([columns.text or columns.json])
    if world_size > 1:
        dataset = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    return sum(1 for _ in dataset)


def timed_count(source: StreamSource, *, rank: int, world_size: int) -> tuple[int, float]:
    start = time.perf_counter()
    return count_rows(source, rank=rank, world_size=world_size), time.perf_counter() - start
