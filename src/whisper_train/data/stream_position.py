"""Where a process stands in its stream, saved in its checkpoints: `StreamPosition` (the pass,
the rows and items each DataLoader worker handed out in it, and the settings that decide which
rows those are), and the one-line summary of the clips a pass skipped. How a resumed stream
replays up to that position is `streaming`'s.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from whisper_train.data.examples import Skip
from whisper_train.errors import UserError


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
