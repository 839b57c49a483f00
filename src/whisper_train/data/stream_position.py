"""Where a process stands in its stream, saved in its checkpoints: `StreamPosition` (the pass,
the rows and micro-batches each DataLoader worker handed out in it), and the one-line summary
of the clips a pass skipped. How a resumed stream replays up to that position is
`streaming`'s; what decides which rows those are (seed, shuffle buffer, workers, packing, the
clips a step) is in the run's record, which a resume compares (`config.record`).

A resume on another number of processes finishes the interrupted pass first (`PassRest`): the
rows the checkpoint's processes had not read, dealt to this run's; the position then counts
rows of that rest, and names the checkpoint's processes and places it was made from.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from whisper_train.data.examples import Skip
from whisper_train.errors import UserError


@dataclass
class StreamPosition:
    """One process's place in its stream: the pass, and the rows and micro-batches each worker
    handed out in it."""

    epoch: int = 0
    rows: dict[int, int] = field(default_factory=dict)  # worker → rows consumed in `epoch`
    skipped: dict[str, int] = field(default_factory=dict)  # reason → clips, this epoch
    epoch_rows: dict[int, int] = field(default_factory=dict)  # finished epoch → rows read
    # worker → micro-batches it handed out in `epoch`
    batches: dict[int, int] = field(default_factory=dict)
    # While finishing a pass begun on another number of processes: what is left of it (`rows`
    # and `batches` count rows and micro-batches of that rest); None in a pass of its own.
    rest: PassRest | None = None

    def advance(self, stream_rows: dict[int, int], stream_batches: dict[int, int]) -> None:
        for worker, n in stream_rows.items():
            self.rows[worker] = max(self.rows.get(worker, 0), n)
        for worker, n in stream_batches.items():
            self.batches[worker] = self.batches.get(worker, 0) + n

    def count_skips(self, skipped: list[Skip]) -> None:
        for item in skipped:
            self.skipped[item.reason] = self.skipped.get(item.reason, 0) + 1

    def finish_epoch(self) -> int:
        """Close the pass: rows read in it; the next pass starts at row 0 of every worker."""
        rows = sum(self.rows.values())
        self.epoch_rows[self.epoch] = rows
        self.epoch, self.rows, self.skipped, self.batches = self.epoch + 1, {}, {}, {}
        self.rest = None
        return rows

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict, *, folder: Path) -> StreamPosition:
        """A checkpoint's position. One saved before micro-batches were counted (its `items`:
        clips or windows a worker handed out) is refused: its micro-batches were planned
        otherwise, so no resume of it trains what the uninterrupted run would have."""
        if "batches" not in values:
            raise UserError(
                f"--resume {folder}: its stream position was saved by an earlier whisper-train, "
                "which cut a stream into other micro-batches; resume it with that version, or "
                "start a new run"
            )
        return cls(
            epoch=int(values["epoch"]),
            rows={int(k): int(v) for k, v in values.get("rows", {}).items()},
            skipped=dict(values.get("skipped", {})),
            epoch_rows={int(k): int(v) for k, v in values.get("epoch_rows", {}).items()},
            batches={int(k): int(v) for k, v in values["batches"].items()},
            rest=PassRest.from_dict(values["rest"]) if values.get("rest") else None,
        )


@dataclass
class PassRest:
    """What the processes of a checkpoint saved on another count had not read of their passes:
    `processes` of them, each at `places[p]` = (its pass, {worker: rows read in it}). The rest
    runs to the end of pass `last_epoch` (the furthest of them): a process still in an earlier
    pass has its whole share of each later one left."""

    processes: int
    places: list[tuple[int, dict[int, int]]]

    @property
    def last_epoch(self) -> int:
        return max(epoch for epoch, _ in self.places)

    @classmethod
    def of(cls, positions: list[StreamPosition]) -> PassRest | None:
        """The rest left by the checkpoint's processes' `positions`; None where none is left
        (every process at the start of one pass: the new count splits that pass anew)."""
        if len({p.epoch for p in positions}) == 1 and not any(p.rows for p in positions):
            return None
        return cls(len(positions), [(p.epoch, dict(p.rows)) for p in positions])

    @classmethod
    def from_dict(cls, values: dict) -> PassRest:
        places = [
            (int(epoch), {int(k): int(v) for k, v in rows.items()})
            for epoch, rows in values["places"]
        ]
        return cls(int(values["processes"]), places)


def skip_summary(skipped: dict[str, int]) -> str:
    if not skipped:
        return "0 skipped"
    reasons = ", ".join(f"{n} {reason}" for reason, n in Counter(skipped).most_common())
    return f"{sum(skipped.values())} skipped ({reasons})"
