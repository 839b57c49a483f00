"""Length-grouped batching: utterances of similar label length share a batch.

Labels are padded to the longest in each batch (`collate.SpeechCollator`), so a batch mixing
a 5-token and a 200-token transcript spends most of its decoder work, and the logits' memory
(batch x tokens x 51,865 floats), on padding. Grouping by length cuts that padding while
keeping the order random enough for training:

  1. shuffle all indices (seeded by seed and epoch),
  2. cut the shuffled list into pools of `pool_batches` batches,
  3. sort each pool by length and cut it into batches (similar lengths together),
  4. shuffle the order of all batches, so long and short batches alternate through the epoch.

transformers' `LengthGroupedSampler` does steps 1-3 for its Trainer; it yields indices (not
batches) and leaves batch order sorted within each pool, hence this small sampler.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from torch.utils.data import Sampler


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices grouped by `lengths`; the same batches for a seed and epoch.

    Pass as `DataLoader(dataset, batch_sampler=...)` and call `set_epoch(epoch)` before each
    epoch. `lengths[i]` is example i's label length in tokens (any per-example size works).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        seed: int = 0,
        pool_batches: int = 50,
        drop_last: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if pool_batches < 1:
            raise ValueError(f"pool_batches must be at least 1, got {pool_batches}")
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.pool_batches = pool_batches  # 1 = no grouping beyond one batch; larger = less padding
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.drop_last:
            return len(self.lengths) // self.batch_size
        return -(-len(self.lengths) // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        rng = random.Random(f"{self.seed}:{self.epoch}")  # independent of the global RNGs
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        pool_size = self.batch_size * self.pool_batches
        batches: list[list[int]] = []
        for start in range(0, len(order), pool_size):
            # Longest first within a pool; ties keep the shuffled order (sort is stable).
            pool = sorted(order[start : start + pool_size], key=lambda i: -self.lengths[i])
            batches.extend(
                pool[i : i + self.batch_size] for i in range(0, len(pool), self.batch_size)
            )
        if self.drop_last:
            batches = [batch for batch in batches if len(batch) == self.batch_size]
        rng.shuffle(batches)
        return iter(batches)


def padding_fraction(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """Share of label positions that are padding when each batch pads to its longest."""
    padded = sum(len(batch) * max(lengths[i] for i in batch) for batch in batches if batch)
    real = sum(lengths[i] for batch in batches for i in batch)
    return 1.0 - real / padded if padded else 0.0
