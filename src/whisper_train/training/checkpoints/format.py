"""A checkpoint's format: its file names, the trainer's state it keeps (`TrainerState`), how
checkpoints are found in a run folder, and how big one is. What the files hold is the package's
docstring; writing them is `save`'s, reading them back `load`'s."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from whisper_train.runfolder import CHECKPOINT_PREFIX as PREFIX

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
STREAM_FILE = "stream-{rank}.json"
WEIGHTS_FILE = "trainable.safetensors"
SHARDED_DIR = (
    "sharded"  # --fsdp: the weights' and optimiser's shards (torch.distributed.checkpoint)
)
_NAME = re.compile(rf"^{PREFIX}(\d+)$")


@dataclass
class TrainerState:
    """Where a run stands; saved in every checkpoint as trainer_state.json."""

    step: int = 0  # optimizer steps taken, skipped (bad) steps included
    epoch: int = 0  # the epoch in progress
    steps_in_epoch: int = 0  # steps of this epoch's plan already trained (data read whole)
    # The clips this epoch trained before its plan was redone on a resume with other clips a
    # step (`step_plan.encode_clips`; empty: never redone): the plan leaves them out.
    trained_before_replan: str = ""
    # Saved before steps were planned (checkpoints of earlier versions): micro-batches of the
    # epoch each process had consumed. Read only, to convert (`resume.convert_position`).
    batches_in_epoch: int = 0
    # The guard set and the step whose WER of it later ones are held against: step 0, or the
    # step a --resume first gave that guard at ({"set", "step"}; None: no guard yet).
    guard_start: dict | None = None
    bad_steps_in_a_row: int = 0  # consecutive steps with a NaN/infinite loss or gradient
    skipped_steps: int = 0  # all bad steps of the run
    skipped_clips: int = 0  # clips that could not be decoded
    world_size: int = 1  # processes that saved it (an rng-<rank>.pt each)
    evaluations: list[dict] = field(default_factory=list)  # {"step", "eval_loss", "wer"}

    @classmethod
    def read(cls, folder: Path) -> TrainerState:
        values = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in values.items() if k in known})

    def write(self, folder: Path) -> None:
        (folder / STATE_FILE).write_text(
            json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8"
        )


# -- finding checkpoints ------------------------------------------------------------------


def checkpoint_step(folder: Path) -> int | None:
    match = _NAME.match(folder.name)
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first (a `.tmp` folder never counts)."""
    if not output_dir.is_dir():
        return []
    found = [
        p
        for p in output_dir.iterdir()
        if checkpoint_step(p) is not None and (p / STATE_FILE).is_file()
    ]
    return sorted(found, key=checkpoint_step)


def checkpoint_folders(run_dir: Path) -> list[Path]:
    """Every checkpoint-<step> folder, oldest first, intact or not (`list_checkpoints` counts
    only those with a trainer_state.json)."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=checkpoint_step)
