"""Which rows of a stream each training process reads: its share of a pass (`process_share`),
and, after a resume on another number of processes, the rows of the interrupted pass that the
checkpoint's processes had not read (`RestOfPass`).

A resume on another number of processes (same workers, same clips a step) cannot replay: each
process's share of a pass depends on the count (`split_dataset_by_node`: whole shards, or every
N-th row). It finishes the interrupted pass instead: each worker of each new process reads
again, without decoding, the shares of the checkpoint's processes that its own worker number
read, passes over the rows they had read, and takes every M-th of the rest (M the new count), so
each row left in the pass is trained once; the next pass is split by the new count. Which rows
a step holds then differs from an uninterrupted run's (as it does on another count from the
start); none is trained twice or left out.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from whisper_train.data.stream_position import PassRest, StreamPosition
from whisper_train.data.stream_sources import StreamSource, open_stream
from whisper_train.errors import UserError


def process_share(
    source: StreamSource, *, rank: int, world_size: int, seed: int, shuffle_buffer: int
) -> tuple:
    """(Process `rank`'s share of the source, shuffled by a seeded buffer of `shuffle_buffer`
    rows and the shard order anew every epoch, the source's columns). Iterated inside a
    DataLoader worker, `datasets` gives that worker its own part of the share."""
    from datasets.distributed import split_dataset_by_node

    dataset, columns = open_stream(source)
    dataset = dataset.shuffle(seed=seed, buffer_size=shuffle_buffer)
    if world_size > 1:
        dataset = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    return dataset, columns


class RestOfPass:
    """The rows of a stream's pass that a checkpoint saved on another number of processes had
    not read (`rest`), as process `rank` of `world_size` now reads them: each loader worker
    reads the checkpoint's processes' shares, as the worker of its number read them, in process
    order, passes over the rows they had read (`rest.places`), and takes every `world_size`-th
    of the rows left, from the `rank`-th. The checkpoint had as many workers (the record's
    stream_workers), so every row left goes to one worker of one process."""

    def __init__(
        self, source: StreamSource, rest: PassRest, *, rank, world_size, seed, shuffle_buffer
    ):
        self.source, self.rest = source, rest
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle_buffer = seed, shuffle_buffer

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        left = 0  # rows left so far, over the checkpoint's processes
        for process, (epoch, read) in enumerate(self.rest.places):
            share, _ = process_share(
                self.source,
                rank=process,
                world_size=self.rest.processes,
                seed=self.seed,
                shuffle_buffer=self.shuffle_buffer,
            )
            for pass_ in range(epoch, self.rest.last_epoch + 1):
                share.set_epoch(pass_)
                skip = read.get(worker, 0) if pass_ == epoch else 0
                for index, row in enumerate(share):
                    if index < skip:
                        continue
                    if left % self.world_size == self.rank:
                        yield row
                    left += 1


def saved_positions(folder, read_stream_position) -> list[StreamPosition]:
    """The stream positions of every process that saved checkpoint `folder`: as many as
    process 0's says there were (`StreamData.saved_position`); in a checkpoint saved before
    positions said so, each next one's until one is missing (a checkpoint holds one a
    process)."""
    first = read_stream_position(folder, 0)
    positions = [StreamPosition.from_dict(first, folder=folder)]
    if "processes" in first:
        return positions + [
            StreamPosition.from_dict(read_stream_position(folder, rank), folder=folder)
            for rank in range(1, int(first["processes"]))
        ]
    while True:
        try:
            saved = read_stream_position(folder, len(positions))
        except UserError:  # no position of that process: it had none
            return positions
        positions.append(StreamPosition.from_dict(saved, folder=folder))
