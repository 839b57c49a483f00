"""How data reaches the processes and the device, for training and evaluation alike: each
process's share of the batches (`shard_batches`: every N-th, the shorter shares padded with
empty batches, so every process runs the same collectives), an evaluation set's loader
(`evaluation_loader`), whether loaders pin their batches (`pins_memory`), and a loader
worker's refusal said in its own one line (`in_one_line`). How many loader
workers a run takes is decided with the run's other decisions (`config.resolve`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence

from torch.utils.data import DataLoader

from whisper_train.errors import UserError


def shard_batches(batches: Sequence[list], rank: int, world: int) -> list[list]:
    """Process `rank`'s micro-batches of an epoch's global batches: batches rank, rank + world,
    ... (as accelerate shards a loader), then empty ones ([]) up to ceil(len / world), the count
    every process gets. Step s of one process with batch B x N processes is then step s of one
    process with batch N x B."""
    mine = list(batches[rank::world])
    return mine + [[] for _ in range(math.ceil(len(batches) / world) - len(mine))]


def pins_memory(accelerator) -> bool:
    """Whether a training loader hands out batches in page-locked memory: on CUDA, where the
    step then copies them to the device without waiting (`non_blocking`), while the kernels
    already queued run; elsewhere pinning only costs."""
    return accelerator.device.type == "cuda"


def evaluation_loader(
    dataset, collate: Callable, *, batch_size: int, rank: int, world: int, num_workers: int
) -> DataLoader:
    """Process `rank`'s share of an evaluation set, split as training's (`shard_batches`): the
    set's batches in order, every N-th to each process, the shorter shares padded with empty
    batches. Every process runs the same number of batches (so the same collectives), and
    every clip is scored exactly once: no process is handed a copy to fill its last batch."""
    n = len(dataset)
    batches = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
    return DataLoader(
        dataset,
        batch_sampler=shard_batches(batches, rank, world),
        collate_fn=collate,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
    )


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
