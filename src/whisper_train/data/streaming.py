"""Training data read as a stream: WebDataset and Parquet shards, and hub datasets.

    --data shards/                           a folder of WebDataset .tar shards (KEY.flac + KEY.txt
                                             or KEY.json with `text` and optional `language`)
    --data 'shards/train-{000000..000099}.tar'  the same, named by a brace pattern (or a glob)
    --data parquet/                          a folder of Parquet files in the Hugging Face audio
                                             layout (an `audio` column of {bytes, path} + a text
                                             column)
    --data name:config:split --streaming     a hub dataset, streamed instead of downloaded

Shards are always streamed; nothing is screened before step 1 and nothing is written to disk.
The `datasets` library reads the stream (`load_dataset(..., streaming=True)`): a seeded shuffle
buffer, `split_dataset_by_node` for the processes, and its own split of the shards over the
DataLoader workers of each process, so that one pass over the stream reads every sample once
across N processes x W workers. Audio is decoded in the workers from the bytes in memory
(soundfile, else PyAV, as files are); a clip that does not decode, is empty or over 30 s, or
whose label is too long becomes a `Skip` item that the training loop counts: a bad clip never
stops a run.

Resuming is exact. `datasets`' own state_dict drops the shuffle buffer's contents, which would
change the order after a resume, so the position saved in a checkpoint is instead (epoch, rows
consumed by each worker, items each worker handed out); on resume every worker reads its first
rows again without decoding them and hands out as many `REPLAYED` items as it had handed out
(which the loop drops), so each worker's batches, and the DataLoader's turn among the workers,
continue where the checkpoint was: the remaining batches come in the order an uninterrupted run
would have. (With --packing on an item is a window of several rows: counting rows alone, a
worker would replay more batches than it had handed out, mix replayed rows into its first new
batch, and take its turns out of step with the other workers.) The re-read costs reading those
bytes again, not decoding them.
"""

from __future__ import annotations

import glob
import os
import random
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from whisper_train.audio import (
    AUDIO_SUFFIXES,
    CHUNK_LENGTH,
    SAMPLE_RATE,
    AudioHeader,
    load_audio,
    read_header,
)
from whisper_train.data.examples import Example, Skip, decode_skip
from whisper_train.data.labels import body_length, decoder_positions, label_positions
from whisper_train.data.layouts import (
    AUDIO_COLUMNS,
    DATASETS_EXTRA,
    LANGUAGE_COLUMNS,
    LAYOUTS,
    TEXT_COLUMNS,
)
from whisper_train.data.packing import PackedWindow
from whisper_train.errors import AudioError, UserError

STREAM_FORMATS = ("webdataset", "parquet")
SHARD_SUFFIXES = {".tar": "webdataset", ".parquet": "parquet"}
# WebDataset names a sample's fields by extension: these hold the audio (every format a folder
# of files may hold: M4A from phones, WebM from browsers...).
WEBDATASET_AUDIO = tuple(suffix.lstrip(".") for suffix in AUDIO_SUFFIXES)
# The audio column as raw bytes and path. `datasets` 5 types audio as `Audio`, whose every
# encode imports torchcodec (even with decode=False); a plain struct needs nothing.
RAW_AUDIO = {"bytes": "binary", "path": "string"}
# A hub id: `name` or `owner/name`, optionally `:config` and `:split`.
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?(:[\w.-]*){0,2}$")
_BRACE = re.compile(r"\{([^{}]*)\}")


# -- what --data names ----------------------------------------------------------------------
@dataclass(frozen=True)
class StreamSource:
    """A stream `--data` names: shard files of one format, or a hub dataset."""

    spec: str  # as the user wrote it, for messages
    kind: str  # "webdataset", "parquet" or "hub"
    files: tuple[str, ...] = ()  # shard files (or URLs), in order; empty for a hub dataset

    def describe(self) -> str:
        if self.kind == "hub":
            return f"hub dataset {self.spec} (streamed)"
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
    if not os.path.exists(text) and _HUB_ID.match(text):
        return StreamSource(text, "hub")
    raise UserError(
        f"--data {text} --streaming: only WebDataset or Parquet shards and hub ids stream; "
        "drop --streaming to read this data whole"
    )


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
    key: str | None = None  # WebDataset's sample key
    url: str | None = None  # WebDataset's shard name

    def wanted(self) -> list[str]:
        named = [*self.audio, self.text, self.json, self.language, self.key, self.url]
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
        origin = f"{shard}:{row[columns.key]}"
    elif isinstance(audio, dict) and audio.get("path"):
        origin = str(audio["path"])
    else:
        origin = fallback_origin
    return Row(audio, text if isinstance(text, str) else None, language or None, origin)


def decode_audio(audio: Any, origin: str) -> np.ndarray:
    """Audio bytes (or a path) → float32 mono at 16 kHz, decoded in memory by the readers a
    file goes through (soundfile, else PyAV: an M4A in a shard trains like one in a folder);
    AudioError naming `origin` when it does not decode or holds no samples."""
    source = _row_audio(audio)
    if source is None:
        raise AudioError(origin, "no audio bytes in this sample")
    return load_audio(source, origin=origin if isinstance(source, bytes) else None)


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


# -- the training stream --------------------------------------------------------------------
# A row a resumed worker reads again without decoding: the loop already trained on it.
REPLAYED = None


class SpeechStream(torch.utils.data.IterableDataset):
    """This process's share of the shuffled stream → (worker, row, item) triples, where item is
    what `SpeechDataset` gives ({"audio", "tokens", ...} or a `Skip`) or REPLAYED.

    Made by `training_stream`. `set_epoch(e)` selects the pass (each pass is shuffled anew);
    `replay_rows` {worker: n} makes each worker re-read its first n rows of that pass without
    decoding them, and `replay_items` {worker: m} hand out m REPLAYED items for them, the items
    (clips or packed windows) it had handed out from those rows (a resumed run). Without
    `replay_items` (a checkpoint from before it was saved) a worker hands out one a row.
    """

    def __init__(
        self,
        dataset,
        columns: Columns,
        label_encoder,
        *,
        max_label_tokens: int,
        seed: int,
        augmenter=None,
        packing: bool = False,
        gap_seconds: float = 0.3,
        packing_timestamps: bool = False,
    ):
        self.dataset = dataset
        self.columns = columns
        self.label_encoder = label_encoder
        self.max_label_tokens = max_label_tokens
        self.seed = seed
        self.augmenter = augmenter
        self.epoch = 0
        self.replay_rows: dict[int, int] = {}
        self.replay_items: dict[int, int] = {}
        self.packing = packing
        self.gap_seconds = gap_seconds
        self.packing_timestamps = packing_timestamps

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int, dict | Skip | None]]:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        replay = self.replay_rows.get(worker, 0)
        # Iterated inside a DataLoader worker, `datasets` gives this worker its own shards.
        rows = self._rows(worker, replay)
        handed_out = self.replay_items.get(worker)
        if handed_out is not None:
            # As many REPLAYED items as were handed out, so the worker's batches fill as they
            # did; the rows they came from are read through (never decoded) before the rest.
            yield from ((worker, replay - 1, REPLAYED) for _ in range(handed_out))
            rows = (row for row in rows if row[2] is not REPLAYED)
        yield from self._packed(rows) if self.packing else rows

    def _rows(self, worker: int, replay: int):
        for index, row in enumerate(self.dataset):
            if index < replay:
                yield worker, index, REPLAYED
            else:
                yield worker, index, self._item(row, worker, index)

    def _packed(self, rows):
        """--packing on: consecutive clips of this worker's rows packed into windows of at most
        30 s and `max_label_tokens` positions (next fit: a clip that does not fit starts the
        next window). A window is handed out with the last row it covers, skips included, so
        the rows a checkpoint counts as consumed are exactly those of the windows trained on:
        a resumed worker starts its next window at that row, as the uninterrupted one did."""
        # 2 time tokens a clip wherever a window's label may be timestamped
        per_clip = 2 if self.label_encoder.timestamps or self.packing_timestamps else 0
        window, skipped = PackedWindow(self.gap_seconds), []
        first_row, n_prefix, body, language = 0, 0, 0, None  # of the open window's label
        last = None  # (worker, row) of the last row read
        for worker, index, item in rows:
            if item is REPLAYED:
                yield worker, index, item
                continue
            if isinstance(item, Skip):
                skipped.append(item)
                last = (worker, index)
                continue
            clip_body = body_length(len(item["tokens"]), item["n_prefix"]) + per_clip
            if len(window) and (
                not window.fits(item["audio"])
                or label_positions(n_prefix, body + clip_body) > self.max_label_tokens
                or item.get("language") != language
            ):
                yield self._window_item(window, skipped, worker, index - 1, first_row, language)
                window, skipped = PackedWindow(self.gap_seconds), []
            if not len(window):
                first_row, n_prefix, body = index, item["n_prefix"], 0
                language = item.get("language")
            window.add(item["audio"], item["text"])
            body += clip_body
            last = (worker, index)
        if last is not None and (len(window) or skipped):
            yield self._window_item(window, skipped, *last, first_row, language)

    def _window_item(
        self,
        window: PackedWindow,
        skipped: list[Skip],
        worker: int,
        last_row: int,
        first_row: int,
        language: str | None,
    ) -> tuple[int, int, dict]:
        """(worker, last row, window item) of a closed window; one that holds no clip carries
        only the skips."""
        item: dict = {"skipped": skipped}
        if len(window):
            rng = random.Random(f"{self.seed}:{self.epoch}:{worker}:{first_row}:window")
            item.update(
                window.item(
                    self.label_encoder,
                    language=language,
                    rng=rng,
                    packing_timestamps=self.packing_timestamps,
                ),
                index=first_row,
            )
        return worker, last_row, item

    def _item(self, row: dict, worker: int, index: int) -> dict | Skip:
        where = read_row(row, self.columns, f"stream row {worker}:{index}")
        if not where.text or not where.text.strip():
            return Skip(where.origin, "empty transcript")
        try:
            audio = decode_audio(where.audio, where.origin)
        except AudioError as exc:  # undecodable, or NaN/inf samples that would poison a batch
            return decode_skip(where.origin, exc)
        seconds = len(audio) / SAMPLE_RATE
        if seconds > CHUNK_LENGTH:
            return Skip(where.origin, f"longer than {CHUNK_LENGTH} s", f"{seconds:.1f} s")
        example = Example(
            audio=where.origin,
            text=where.text.strip(),
            language=where.language,
            origin=where.origin,
        )
        rng = random.Random(f"{self.seed}:{self.epoch}:{worker}:{index}")
        try:
            tokens, n_prefix = self.label_encoder.encode(example, rng=rng)
        except UserError as exc:  # a language the model cannot write, for one row
            return Skip(where.origin, "unusable language", str(exc))
        positions = decoder_positions(len(tokens))
        if positions > self.max_label_tokens:
            return Skip(
                where.origin,
                f"label longer than {self.max_label_tokens} tokens",
                f"{positions} tokens",
            )
        if self.augmenter is not None:
            audio = self.augmenter(audio, rng)
        return {
            "audio": audio,
            "tokens": tokens,
            "n_prefix": n_prefix,
            "text": example.text,
            "index": index,
            "language": example.language,
        }


class StreamCollator:
    """(worker, row, item) triples → the inner collator's batch of the items, plus
    `stream_rows` {worker: rows it has handed out so far} and `stream_items` {worker: items
    (not REPLAYED) of this batch}; a batch of only REPLAYED rows is {"replayed": True,
    "stream_rows": ..., "stream_items": {}}."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, triples) -> dict:
        rows: dict[int, int] = {}
        handed_out: dict[int, int] = {}
        for worker, index, item in triples:
            rows[worker] = max(rows.get(worker, 0), index + 1)
            if item is not REPLAYED:
                handed_out[worker] = handed_out.get(worker, 0) + 1
        items = [item for _, _, item in triples if item is not REPLAYED]
        if not items:
            return {"replayed": True, "stream_rows": rows, "stream_items": handed_out}
        batch = self.collator(items)
        batch["stream_rows"] = rows
        batch["stream_items"] = handed_out
        return batch


def training_stream(
    source: StreamSource,
    label_encoder,
    *,
    rank: int,
    world_size: int,
    seed: int,
    shuffle_buffer: int,
    max_label_tokens: int,
    augmenter=None,
    packing: bool = False,
    packing_timestamps: bool = False,
) -> SpeechStream:
    """Process `rank`'s share of the source, shuffled by a seeded buffer of `shuffle_buffer`
    rows (and the shard order, anew every epoch); the DataLoader's workers split it further."""
    from datasets.distributed import split_dataset_by_node

    dataset, columns = open_stream(source)
    dataset = dataset.shuffle(seed=seed, buffer_size=shuffle_buffer)
    if world_size > 1:
        dataset = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    return SpeechStream(
        dataset,
        columns,
        label_encoder,
        max_label_tokens=max_label_tokens,
        seed=seed,
        augmenter=augmenter,
        packing=packing,
        packing_timestamps=packing_timestamps,
    )


def count_rows(source: StreamSource, *, rank: int = 0, world_size: int = 1) -> int:
    """Rows in process `rank`'s share of the stream (the sum over ranks is the whole), read
    without decoding: Parquet reads only the text column, WebDataset reads the tars through."""
    from datasets.distributed import split_dataset_by_node

    dataset, columns = open_stream(source)
    dataset = dataset.select_columns([columns.text or columns.json])
    if world_size > 1:
        dataset = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    return sum(1 for _ in dataset)


# -- where a process stands in its stream (saved in checkpoints) ----------------------------
@dataclass
class StreamPosition:
    """One process's place in its stream: the pass, rows each worker handed out in it, and the
    settings that decide which rows those are (a resume must use the same)."""

    epoch: int = 0
    rows: dict[int, int] = field(default_factory=dict)  # worker → rows consumed in `epoch`
    settings: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # reason → clips, this epoch
    epoch_rows: dict[int, int] = field(default_factory=dict)  # finished epoch → rows read
    # worker → items (clips, or packed windows) handed out in `epoch`; None: not counted (a
    # checkpoint from before it was), and a resumed worker hands out one REPLAYED item a row
    items: dict[int, int] | None = field(default_factory=dict)

    def advance(self, stream_rows: dict[int, int], stream_items: dict[int, int]) -> None:
        for worker, n in stream_rows.items():
            self.rows[worker] = max(self.rows.get(worker, 0), n)
        if self.items is not None:
            for worker, n in stream_items.items():
                self.items[worker] = self.items.get(worker, 0) + n

    def count_skips(self, skipped: list[Skip]) -> None:
        for item in skipped:
            self.skipped[item.reason] = self.skipped.get(item.reason, 0) + 1

    def finish_epoch(self) -> int:
        """Close the pass: rows read in it; the next pass starts at row 0 of every worker."""
        rows = sum(self.rows.values())
        self.epoch_rows[self.epoch] = rows
        self.epoch, self.rows, self.skipped, self.items = self.epoch + 1, {}, {}, {}
        return rows

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> StreamPosition:
        return cls(
            epoch=int(values["epoch"]),
            rows={int(k): int(v) for k, v in values.get("rows", {}).items()},
            settings=dict(values.get("settings", {})),
            skipped=dict(values.get("skipped", {})),
            epoch_rows={int(k): int(v) for k, v in values.get("epoch_rows", {}).items()},
            items=(
                {int(k): int(v) for k, v in values["items"].items()} if "items" in values else None
            ),
        )

    def check_resumable(self, settings: dict[str, Any], folder: Path) -> None:
        """UserError when this run's stream would not be the one the checkpoint consumed."""
        for name, saved in self.settings.items():
            if settings.get(name) != saved:
                flag = "--" + name.replace("_", "-")
                raise UserError(
                    f"--resume {folder}: its stream position holds for {flag} {saved}, this run "
                    f"has {settings.get(name)}; resume with {flag} {saved}"
                )


def skip_summary(skipped: dict[str, int]) -> str:
    if not skipped:
        return "0 skipped"
    reasons = ", ".join(f"{n} {reason}" for reason, n in Counter(skipped).most_common())
    return f"{sum(skipped.values())} skipped ({reasons})"


def timed_count(source: StreamSource, *, rank: int, world_size: int) -> tuple[int, float]:
    start = time.perf_counter()
    return count_rows(source, rank=rank, world_size=world_size), time.perf_counter() - start


__all__ = [
    "STREAM_FORMATS",
    "Columns",
    "SpeechStream",
    "StreamCollator",
    "StreamPosition",
    "StreamSource",
    "audio_header",
    "count_rows",
    "decode_audio",
    "expand_braces",
    "open_stream",
    "read_row",
    "stream_source",
    "training_stream",
]
