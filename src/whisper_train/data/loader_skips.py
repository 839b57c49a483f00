"""The clips a training run's loaders skipped as they read them (missing, empty, undecodable,
NaN samples), gathered from every process and each named once: `LoaderSkips`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from accelerate.utils import gather_object

from whisper_train.data.examples import Skip
from whisper_train.data.screening import summarize_skips
from whisper_train.runlog import say


class LoaderSkips:
    """The clips a training loader skipped as it read them, on every process, each named once.

    Each process `add`s what its micro-batches skipped; `gather` (a collective: every process
    calls it at the same place, whatever its data) hands every process the same list of the
    clips no earlier `gather` returned, in process order. A clip met again in a later epoch, or
    by another process, is not named (nor counted) again."""

    def __init__(self):
        self.pending: dict[str, Skip] = {}  # this process's, since the last gather
        self.named: dict[str, Skip] = {}  # every process's, by origin, returned once

    def add(self, skips: Iterable[Skip]) -> None:
        for skip in skips:
            if skip.origin not in self.named:
                self.pending.setdefault(skip.origin, skip)

    def gather(self, process) -> list[Skip]:
        """Every process's clips skipped since the last gather and never returned before."""
        mine, self.pending = list(self.pending.values()), {}
        everyone = gather_object(mine) if process.num_processes > 1 else mine
        new = []
        for skip in everyone:
            if skip.origin not in self.named:
                self.named[skip.origin] = skip
                new.append(skip)
        return new

    def say(self, process, when: str, new: Sequence[Skip], state) -> None:
        """Name `new` (a `gather`'s clips, which no line named before) in one report, and count
        them in `state.skipped_clips`: each clip once, whichever process met it and however
        many epochs read it. (A resumed run names again what it meets again, and counts the
        larger of its own and the checkpoint's count: the same clips, most likely.)"""
        if new:
            say(process, f"{when}: clips skipped as they were read: " + summarize_skips(new))
            state.skipped_clips = max(state.skipped_clips, len(self.named))

    def reasons(self) -> str:
        """'2 audio file not found, 1 unreadable audio': every clip named so far, by reason."""
        counts = Counter(skip.reason for skip in self.named.values())
        return ", ".join(f"{n} {reason}" for reason, n in counts.most_common())


__all__ = ["LoaderSkips"]
