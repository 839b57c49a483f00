"""Training data read as a stream: WebDataset and Parquet shards, lhotse cuts, hub datasets.

This module holds the stream a training process iterates (`SpeechStream`, made by
`training_stream`) and the collator that counts the rows its batches consumed
(`StreamCollator`). What `--data` names, opening it and reading its rows are `stream_sources`'s
(which lists the formats); the position a checkpoint saves is `stream_position`'s. Their public
names import from here too.

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

import random
from collections.abc import Iterable, Iterator

import torch

from whisper_train.audio import CHUNK_LENGTH, SAMPLE_RATE
from whisper_train.data.examples import Example, Skip, decode_skip
from whisper_train.data.labels import body_length, decoder_positions, label_positions
from whisper_train.data.packing import PackedWindow
from whisper_train.data.stream_position import StreamPosition, skip_summary
from whisper_train.data.stream_sources import (
    RAW_AUDIO,
    SHARD_SUFFIXES,
    STREAM_FORMATS,
    WEBDATASET_AUDIO,
    Columns,
    Row,
    StreamSource,
    audio_header,
    count_rows,
    decode_audio,
    expand_braces,
    open_stream,
    read_row,
    stream_source,
    timed_count,
)
from whisper_train.errors import AudioError, UserError

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
            audio = decode_audio(where.audio, where.origin, start=where.start, end=where.end)
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


def in_one_line(batches: Iterable) -> Iterator:
    """A DataLoader's `batches`, with a UserError raised in a loader worker (a stream's file
    damaged past the rows read before step 1) re-raised as its own one line: the DataLoader
    re-raises it with the worker's traceback as its message."""
    try:
        yield from batches
    except UserError as exc:
        text, marker = str(exc), f"{UserError.__module__}.{UserError.__qualname__}: "
        if "\n" not in text or marker not in text:
            raise
        raise UserError(text.rsplit(marker, 1)[1].strip()) from None


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


__all__ = [
    "RAW_AUDIO",
    "SHARD_SUFFIXES",
    "STREAM_FORMATS",
    "WEBDATASET_AUDIO",
    "Columns",
    "Row",
    "SpeechStream",
    "StreamCollator",
    "StreamPosition",
    "StreamSource",
    "audio_header",
    "count_rows",
    "decode_audio",
    "expand_braces",
    "in_one_line",
    "open_stream",
    "read_row",
    "skip_summary",
    "stream_source",
    "timed_count",
    "training_stream",
]
