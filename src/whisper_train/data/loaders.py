"""How data reaches the processes and the device, for training and evaluation alike: each
process's share of the batches (`shard_batches`: every N-th, the shorter shares padded with
empty batches, so every process runs the same collectives), an evaluation set's loader
(`evaluation_loader`), and the loaders' device-dependent settings (`default_num_workers`,
`pins_memory`)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

from torch.utils.data import DataLoader


def shard_batches(batches: Sequence[list], rank: int, world: int) -> list[list]:
    """Process `rank`'s micro-batches of an epoch's global batches: batches rank, rank + world,
    ... (as accelerate shards a loader), then empty ones ([]) up to ceil(len / world), the count
    every process gets. Step s of one process with batch B x N processes is then step s of one
    process with batch N x B."""
    mine = list(batches[rank::world])
    return mine + [[] for _ in range(math.ceil(len(batches) / world) - len(mine))]


# Measured on an H200 with 16 CPUs (BENCHMARKS.md "Compiled, and data workers"): whisper-small
# compiled at batch 16 waited ~22 ms a step for clips read and turned into log-mel features in
# the training process (133 ms a step); 4 workers did that while the device trained (110 ms).
CUDA_DATA_WORKERS = 4


def default_num_workers(requested: int | None, accelerator) -> int:
    """--num-workers, or its default: CUDA_DATA_WORKERS per process on a CUDA GPU, fewer where
    the machine has fewer CPUs (one left to each training process), and none elsewhere: on a
    CPU the workers would take the cores that the training step itself runs on."""
    if requested is not None:
        return requested
    if accelerator.device.type != "cuda":
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    on_this_machine = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    return max(0, min(CUDA_DATA_WORKERS, (cpus or 1) // max(1, on_this_machine) - 1))


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
