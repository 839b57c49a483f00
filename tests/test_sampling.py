"""Length-grouped batches: less padding, every example once, reproducible, still shuffled."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from whisper_train.data.sampling import LengthGroupedBatchSampler, padding_fraction


def _lengths(n: int = 400, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 200) for _ in range(n)]


def test_every_example_appears_exactly_once_per_epoch():
    lengths = _lengths(403)  # not a multiple of the batch size
    sampler = LengthGroupedBatchSampler(lengths, 8, seed=1)
    batches = list(sampler)
    assert sorted(i for batch in batches for i in batch) == list(range(403))
    assert len(batches) == len(sampler) == 51
    assert all(len(batch) == 8 for batch in batches if len(batch) != 403 % 8)


def test_drop_last_keeps_only_full_batches():
    sampler = LengthGroupedBatchSampler(_lengths(403), 8, seed=1, drop_last=True)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 50
    assert all(len(batch) == 8 for batch in batches)


def test_grouping_cuts_padding_compared_with_random_batches():
    lengths = _lengths()
    grouped = list(LengthGroupedBatchSampler(lengths, 8, seed=0))
    generator = torch.Generator().manual_seed(0)
    plain = list(BatchSampler(RandomSampler(range(len(lengths)), generator=generator), 8, False))
    assert padding_fraction(grouped, lengths) < 0.5 * padding_fraction(plain, lengths)


def test_same_seed_and_epoch_give_the_same_batches_and_epochs_differ():
    lengths = _lengths()
    first = LengthGroupedBatchSampler(lengths, 8, seed=3)
    second = LengthGroupedBatchSampler(lengths, 8, seed=3)
    assert list(first) == list(second)
    epoch0 = list(first)
    first.set_epoch(1)
    assert list(first) != epoch0
    assert list(LengthGroupedBatchSampler(lengths, 8, seed=4)) != epoch0


def test_batch_order_is_shuffled_not_sorted_by_length():
    lengths = _lengths()
    batches = list(LengthGroupedBatchSampler(lengths, 8, seed=0))
    longest = [max(lengths[i] for i in batch) for batch in batches]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


def test_works_as_a_dataloader_batch_sampler():
    lengths = _lengths(20)
    sampler = LengthGroupedBatchSampler(lengths, 4, seed=0)
    loader = DataLoader(list(range(20)), batch_sampler=sampler, collate_fn=list)
    assert [batch for batch in loader] == list(sampler)


def test_rejects_a_zero_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        LengthGroupedBatchSampler([1, 2], 0)
