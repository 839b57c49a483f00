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

A resume on another number of processes finishes the interrupted pass first
(`stream_shares.RestOfPass`, which says how).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator

import torch
from accelerate.utils import reduce
from torch.utils.data import DataLoader

from whisper_train.audio import CHUNK_LENGTH, SAMPLE_RATE
from whisper_train.data.examples import Example, Skip, decode_skip
from whisper_train.data.labels import body_length, decoder_positions, label_positions
from whisper_train.data.loader_skips import LoaderSkips
from whisper_train.data.loaders import in_one_line, pins_memory
from whisper_train.data.packing import PackedWindow
from whisper_train.data.step_plan import group_steps
from whisper_train.data.stream_position import PassRest, StreamPosition, skip_summary
from whisper_train.data.stream_shares import RestOfPass, process_share, saved_positions
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
from whisper_train.errors import AudioError, RunRefused, UserError
from whisper_train.runlog import say

# -- the training stream --------------------------------------------------------------------
# A row a resumed worker reads again without decoding: the loop already trained on it.
REPLAYED = None


class SpeechStream(torch.utils.data.IterableDataset):
    """This process's share of the shuffled stream → micro-batches of about `batch_size` clips,
    each a list of (worker, row, item) triples, where item is what `SpeechDataset` gives
    ({"audio", "tokens", ...} or a `Skip`; packed, a window of clips) or REPLAYED. Each worker
    makes its own micro-batches of its own rows.

    Made by `training_stream`. `set_epoch(e)` selects the pass (each pass is shuffled anew);
    `replay_rows` {worker: n} makes each worker re-read its first n rows of that pass without
    decoding them, and `replay_batches` {worker: m} hand out m REPLAYED micro-batches for them,
    as many as it had handed out from those rows (a resumed run).
    """

    def __init__(
        self,
        dataset,
        columns: Columns,
        label_encoder,
        *,
        max_label_tokens: int,
        seed: int,
        batch_size: int = 1,
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
        self.replay_batches: dict[int, int] = {}
        # Set while finishing a pass begun on another number of processes: read in its place.
        self.rest: RestOfPass | None = None
        self.batch_size = batch_size
        self.packing = packing
        self.gap_seconds = gap_seconds
        self.packing_timestamps = packing_timestamps

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[tuple[int, int, dict | Skip | None]]]:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        replay = self.replay_rows.get(worker, 0)
        # Iterated inside a DataLoader worker, `datasets` gives this worker its own shards.
        rows = self._rows(worker, replay)
        handed_out = self.replay_batches.get(worker)
        if handed_out is not None:
            # As many REPLAYED micro-batches as were handed out, so the DataLoader's turns
            # among the workers continue as they were; the rows they came from are read
            # through (never decoded) before the rest.
            yield from ([(worker, replay - 1, REPLAYED)] for _ in range(handed_out))
            rows = (row for row in rows if row[2] is not REPLAYED)
        yield from self._micro_batches(self._packed(rows) if self.packing else rows)

    def _micro_batches(self, items) -> Iterator[list]:
        """This worker's items as micro-batches of about `batch_size` clips: unpacked, that
        many items; packed, whole windows (each of at most `batch_size` clips) until the next
        would overshoot the clips asked more than stopping short of them (`step_plan`'s rule,
        one window ahead). An item that holds no clip (only skips, or REPLAYED) counts none."""
        batch: list = []
        clips = 0
        for item in items:
            count = _clips_of(item[2]) if self.packing else 1
            overshoot = clips + count - self.batch_size
            if self.packing and batch and overshoot > 0 and overshoot > self.batch_size - clips:
                yield batch  # this window starts the next micro-batch
                batch, clips = [], 0
            batch.append(item)
            clips += count
            if clips >= self.batch_size:
                yield batch
                batch, clips = [], 0
        if batch:
            yield batch

    def _rows(self, worker: int, replay: int):
        for index, row in enumerate(self.dataset if self.rest is None else self.rest):
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
                len(window) >= self.batch_size  # a window holds at most a micro-batch's clips
                or not window.fits(item["audio"])
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
        item: dict = {"skipped": skipped, "clip_count": len(window)}
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


def _clips_of(item) -> int:
    """Clips a packed stream's item holds (a window's count; none for REPLAYED or a skip)."""
    return item.get("clip_count", 1) if isinstance(item, dict) else 0


class StreamCollator:
    """One worker's micro-batch of (worker, row, item) triples → the inner collator's batch of
    the items, plus `stream_rows` {worker: rows it has handed out so far} and `stream_batches`
    {worker: 1 when this micro-batch is new, not REPLAYED}; a micro-batch of only REPLAYED
    rows is {"replayed": True, "stream_rows": ..., "stream_batches": {}}."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, triples) -> dict:
        rows: dict[int, int] = {}
        for worker, index, _ in triples:
            rows[worker] = max(rows.get(worker, 0), index + 1)
        items = [item for _, _, item in triples if item is not REPLAYED]
        if not items:
            return {"replayed": True, "stream_rows": rows, "stream_batches": {}}
        batch = self.collator(items)
        batch["stream_rows"] = rows
        batch["stream_batches"] = {triples[0][0]: 1}
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
    batch_size: int,
    augmenter=None,
    packing: bool = False,
    packing_timestamps: bool = False,
) -> SpeechStream:
    """Process `rank`'s share of the source (`process_share`) as micro-batches; the
    DataLoader's workers split it further."""
    dataset, columns = process_share(
        source, rank=rank, world_size=world_size, seed=seed, shuffle_buffer=shuffle_buffer
    )
    return SpeechStream(
        dataset,
        columns,
        label_encoder,
        max_label_tokens=max_label_tokens,
        seed=seed,
        batch_size=batch_size,
        augmenter=augmenter,
        packing=packing,
        packing_timestamps=packing_timestamps,
    )


# -- the training data source of a stream --------------------------------------------------


class StreamPlan:
    """A streamed --data's share of each process, counted before step 1 (one pass of reading,
    without decoding) unless --max-steps makes the count unneeded. A micro-batch is about
    --batch-size clips of one loader worker (packed: whole windows), so a step is about
    --batch-size x --gradient-accumulation x processes clips; which clips depends on how the
    stream's shards fall to the processes and workers (no plan of the whole stream exists)."""

    def __init__(
        self,
        source: StreamSource,
        *,
        process,
        batch_size: int,
        accumulation: int,
        seed: int,
        shuffle_buffer: int,
        packing: bool,
        packing_timestamps: bool,
        counted: bool,
        augmenter=None,
    ):
        self.source = source
        self.batch_size, self.accumulation, self.seed = batch_size, accumulation, seed
        self.shuffle_buffer = shuffle_buffer
        self.packing, self.packing_timestamps = packing, packing_timestamps
        self.augmenter = augmenter
        self.processes = process.num_processes
        self.samples: int | None = None  # samples in one pass, when counted
        self.count_seconds = 0.0
        if counted:
            rows, self.count_seconds = timed_count(
                source, rank=process.process_index, world_size=process.num_processes
            )
            total = torch.tensor([rows], device=process.device)
            self.samples = int(reduce(total, reduction="sum").item())

    @property
    def steps_per_epoch(self) -> int | None:
        if self.samples is None:
            return None
        per_process = math.ceil(self.samples / self.processes)
        return max(1, math.ceil(math.ceil(per_process / self.batch_size) / self.accumulation))

    def summary(self) -> str:
        """The start line's account of the stream, short; `describe` tells the whole of it."""
        counted = f", {self.samples} samples a pass" if self.samples is not None else ""
        return f"streaming {self.source.describe()}{counted}; shuffle buffer {self.shuffle_buffer}"

    def describe(self) -> str:
        counted = ""
        if self.samples is not None:
            counted = (
                f", {self.samples} samples a pass (counted in {self.count_seconds:.1f} s; "
                "--max-steps skips the count)"
            )
        packed = ", packed per worker" if self.packing else ""
        return (
            f"streaming {self.source.describe()}{counted}; shuffle buffer "
            f"{self.shuffle_buffer}{packed}; a micro-batch is one loader worker's, so which "
            "clips a step holds depends on --num-workers and --nproc"
        )


class StreamData:
    """This process's share of a streamed --data (`streaming`), decoded in the loader workers.

    A stream's pass ends on each process at its own micro-batch; the next pass follows at once,
    so steps group micro-batches across passes and every process runs the same number of
    micro-batches per optimizer step. Its position (pass, rows and micro-batches each worker
    handed out) is saved beside the TrainerState and replayed without decoding on --resume.
    """

    def __init__(
        self,
        plan: StreamPlan,
        label_encoder,
        collate: Callable,
        *,
        accelerator,
        num_workers: int,
        max_label_tokens: int,
    ):
        self.plan = plan
        self.source = plan.source
        self.accelerator = accelerator
        self.stream_samples = plan.samples
        self.dataset = training_stream(
            plan.source,
            label_encoder,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            seed=plan.seed,
            shuffle_buffer=plan.shuffle_buffer,
            max_label_tokens=max_label_tokens,
            batch_size=plan.batch_size,
            augmenter=plan.augmenter,
            packing=plan.packing,
            packing_timestamps=plan.packing_timestamps,
        )
        self.position = StreamPosition()
        # The clips skipped, every process's, named once at the end of the run: the processes'
        # passes end at other steps, so no pass's end is a place they all meet to gather.
        self.skips = LoaderSkips()
        # Each worker makes its own micro-batches (`SpeechStream`). Not persistent: the workers
        # are started afresh each pass, with that pass's epoch and rows to replay.
        self.loader = DataLoader(
            self.dataset,
            batch_size=None,
            collate_fn=StreamCollator(collate),
            num_workers=num_workers,
            prefetch_factor=4 if num_workers > 0 else None,
            pin_memory=pins_memory(accelerator),
        )
        # --max-steps without a count: the run's length stands in until a pass is read.
        self.steps_per_epoch = plan.steps_per_epoch

    def steps(self, state) -> Iterator[list[dict]]:
        def passes():
            while True:
                yield from self._pass(state)

        yield from group_steps(passes(), self.plan.accumulation)

    def _pass(self, state) -> Iterator[dict]:
        """This process's next pass over its stream, from its saved place after a resume: the
        micro-batches not yet trained on, in host memory (see `WholeData.steps`)."""
        position, accelerator = self.position, self.accelerator
        self.dataset.set_epoch(position.epoch)
        rest = position.rest
        if rest is not None:  # the pass a checkpoint on another count had begun
            self.dataset.rest = RestOfPass(
                self.source,
                rest,
                rank=accelerator.process_index,
                world_size=accelerator.num_processes,
                seed=self.plan.seed,
                shuffle_buffer=self.plan.shuffle_buffer,
            )
        self.dataset.replay_rows = dict(position.rows)
        # Each worker hands out as many REPLAYED micro-batches as it had handed out.
        self.dataset.replay_batches = dict(position.batches)
        state.epoch = position.epoch
        replayed, usable, micro_batches = sum(position.rows.values()), 0, 0
        for batch in in_one_line(self.loader):
            position.advance(batch.pop("stream_rows"), batch.pop("stream_batches"))
            if batch.get("replayed"):
                continue
            position.count_skips(batch["skipped"])
            self.skips.add(batch["skipped"])
            usable += batch["size"]
            micro_batches += 1
            yield batch
        skipped = position.skipped
        rows = position.finish_epoch()
        self.dataset.replay_rows, self.dataset.replay_batches = {}, {}
        self.dataset.rest = None
        if rest is not None:  # a process may be dealt few rows of a rest, or none
            say(
                accelerator,
                f"stream pass {position.epoch - 1} ended on process 0: {rows} samples of what "
                f"{rest.processes} process(es) had left of it, {skip_summary(skipped)}",
            )
            return
        where = f"--data {self.source.spec}"
        if rows == 0:
            raise UserError(
                f"{where}: process {accelerator.process_index} got no samples in a pass: the "
                f"stream has fewer shards or samples than processes x workers; use fewer "
                "--nproc or --num-workers, or more shards"
            )
        if usable == 0 and replayed == 0:
            raise UserError(
                f"{where}: no usable clip in a whole pass ({rows} samples, "
                f"{skip_summary(skipped)}); run `whisper-train check-data` on it"
            )
        if self.steps_per_epoch is None and replayed == 0:  # now the length of a pass
            self.steps_per_epoch = max(1, math.ceil(micro_batches / self.plan.accumulation))
        say(
            accelerator,
            f"stream pass {position.epoch - 1} ended on process 0: {rows} samples, "
            f"{skip_summary(skipped)}",
        )

    def report_skips(self, when: str, state) -> None:
        """The clips any process's stream skipped, each named once (every process calls this
        at the same step: it gathers). Each pass's end line counts its own on process 0."""
        self.skips.say(self.accelerator, when, self.skips.gather(self.accelerator), state)

    def saved_position(self) -> dict | None:
        # With the count of processes that save one: a resume on another count reads them all.
        return {**self.position.to_dict(), "processes": self.accelerator.num_processes}

    def restore(self, state, *, folder, read_stream_position, replan: bool = False, **_) -> str:
        """Continue at this process's saved place in the stream, read from checkpoint `folder`
        by `read_stream_position` (`training.checkpoints` owns what a checkpoint holds). What
        decides which rows those are was compared with the checkpoint's record: a stream has
        no plan to redo (`replan` is refused there). Saved on another number of processes
        (the record lets it change), the pass they had begun is finished first: the rows
        they had not read, dealt to this run's processes (`RestOfPass`)."""
        accelerator = self.accelerator
        saved = saved_positions(folder, read_stream_position)
        if len(saved) == accelerator.num_processes:
            self.position = saved[accelerator.process_index]
            rest = "" if self.position.rest is None else " of the rest of a pass"
            return (
                f"stream pass {self.position.epoch}, {sum(self.position.rows.values())} samples "
                f"into it{rest} on this process: read again, not decoded"
            )
        begun = next((p.rest.processes for p in saved if p.rest is not None), None)
        if begun is not None:
            raise RunRefused(
                f"--resume {folder}: it was saved on {len(saved)} process(es) while they "
                f"finished a stream pass begun on {begun}, which another "
                f"count cannot continue exactly; resume with --nproc {len(saved)} (or "
                f"{len(saved)} processes in all under a launcher), or start a new run"
            )
        own = saved[accelerator.process_index] if accelerator.process_index < len(saved) else None
        rest = PassRest.of(saved)
        epoch = max(p.epoch for p in saved)
        self.position = StreamPosition(
            epoch=epoch, epoch_rows=dict(own.epoch_rows) if own else {}, rest=rest
        )
        if rest is None:
            return f"stream pass {epoch} from its start, split among {accelerator.num_processes}"
        read = sum(sum(rows.values()) for e, rows in rest.places if e == epoch)
        return (
            f"stream pass {epoch}: the rows {len(saved)} process(es) had not read of it "
            f"(they had read {read}), dealt to {accelerator.num_processes}; read again, not "
            "decoded"
        )

    def summary(self) -> str:
        return self.plan.summary()

    def describe(self) -> str:
        return self.plan.describe()


__all__ = [
    "StreamData",
    "StreamPlan",
    "RAW_AUDIO",
    "SHARD_SUFFIXES",
    "STREAM_FORMATS",
    "WEBDATASET_AUDIO",
    "Columns",
    "Row",
    "SpeechStream",
    "StreamCollator",
    "StreamPosition",
    "RestOfPass",
    "StreamSource",
    "audio_header",
    "count_rows",
    "decode_audio",
    "expand_braces",
    "in_one_line",
    "open_stream",
    "process_share",
    "read_row",
    "saved_positions",
    "skip_summary",
    "stream_source",
    "timed_count",
    "training_stream",
]
