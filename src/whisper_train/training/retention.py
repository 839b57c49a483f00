"""What a run keeps on disk: which checkpoints rotation keeps (`rotate_checkpoints`: the
newest and the best), and the room they and final/ need at their peak, checked before step 1
(`check_room_for_run`) rather than found missing hours later."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from whisper_train.config.record import RunRecord
from whisper_train.errors import UserError
from whisper_train.memory.quantize import weights_held
from whisper_train.training.checkpoints import (
    MANIFEST_FILE,
    STATE_FILE,
    checkpoint_step,
    list_checkpoints,
)
from whisper_train.training.checkpoints.state_dicts import estimate_checkpoint_bytes
from whisper_train.units import format_bytes

# -- rotation ------------------------------------------------------------------------------


def rotate_checkpoints(
    output_dir: Path, *, keep_last: int, keep_steps: Sequence[int], saved_step: int
) -> None:
    """Delete all but the newest `keep_last` checkpoints up to `saved_step` (the one just
    saved) and those of `keep_steps` (the best evaluated step, which final/ will hold:
    `final.choose_final_step`; with --average-by best, the best N). A checkpoint after `saved_step` is never the newest, and is
    not deleted: only a run abandoned by a resume leaves one, and the resume moves those aside
    (`resume.set_aside_later_checkpoints`)."""
    found = [p for p in list_checkpoints(output_dir) if checkpoint_step(p) <= saved_step]
    keep = set(found[-keep_last:])
    keep.update(p for p in found if checkpoint_step(p) in keep_steps)
    for folder in found:
        if folder not in keep:
            _delete_checkpoint(folder)


def _delete_checkpoint(folder: Path) -> None:
    """Its markers first: a deletion killed half-way leaves a folder no resume takes for a
    checkpoint (`list_checkpoints` needs trainer_state.json), not one with files missing."""
    for marker in (MANIFEST_FILE, STATE_FILE):
        (folder / marker).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


# -- space --------------------------------------------------------------------------------


def peak_disk_bytes(
    model: torch.nn.Module, *, checkpoints_kept: int, already_saved: int, final_bytes: int
) -> int:
    """The most disk a run's checkpoints and final model take beyond what is there already.

    `rotate_checkpoints` runs after a save is complete, so at each save `checkpoints_kept`
    (--save-total-limit, plus the best one) are on disk while the next one is written; at the
    end the last rotation has run before final/ is written. `already_saved`: checkpoints of
    the run being resumed, on disk already, that count towards the kept ones.
    """
    one = estimate_checkpoint_bytes(model)
    return max(0, checkpoints_kept - already_saved) * one + max(one, final_bytes)


def check_free_space(output_dir: Path, needed: int, *, what: str) -> None:
    """A clear error before training rather than a failure hours later."""
    probe = output_dir if output_dir.exists() else next(p for p in output_dir.parents if p.exists())
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise UserError(
            f"--output-dir {output_dir}: {format_bytes(free)} free, but {what} need about {format_bytes(needed)}; "
            "free some space or choose another --output-dir"
        )


# -- the room a run needs, before step 1 ---------------------------------------------------


def check_room_for_run(
    model: torch.nn.Module,
    record: RunRecord,
    *,
    output_dir: Path,
    resume_from: Path | None,
) -> int:
    """Refuse now, not after hours of training, a run whose kept checkpoints and final model
    would not fit in `output_dir`; returns the bytes they need (the encoder cache leaves them
    that room)."""
    needed = disk_needed_bytes(model, record, output_dir=output_dir, resume_from=resume_from)
    check_free_space(output_dir, needed, what=disk_needed_text(record))
    return needed


def checkpoints_kept(record: RunRecord) -> int:
    """How many checkpoints rotation keeps: --save-total-limit, plus the best one when
    evaluations during the run can make an older step the best (the best N with
    --average-by best); none when nothing but a stop saves one (the run ends there, before
    final/ is written)."""
    evaluation, output = record.evaluation, record.output
    evaluating_during = bool(evaluation.evaluating and evaluation.eval_steps)
    if not (output.save_steps or evaluating_during):
        return 0
    return output.save_total_limit + (best_kept(record) if evaluating_during else 0)


def best_kept(record: RunRecord) -> int:
    """How many of the best evaluated steps' checkpoints rotation keeps beside the newest."""
    output = record.output
    return output.average_checkpoints if output.average_by == "best" else 1


def disk_needed_text(record: RunRecord) -> str:
    """What `disk_needed_bytes` counts, for the line that refuses too little space."""
    kept, limit = checkpoints_kept(record), record.output.save_total_limit
    if kept == 0:
        return "the final model (or a checkpoint, when the run is stopped)"
    best = (
        f" + the best {kept - limit}" if kept > limit + 1 else " + the best" if kept > limit else ""
    )
    return (
        f"the {kept} checkpoints rotation keeps (--save-total-limit {limit}{best}), with "
        "one more being written or the final model,"
    )


def disk_needed_bytes(
    model: torch.nn.Module, record: RunRecord, *, output_dir: Path, resume_from: Path | None
) -> int:
    """Disk the checkpoints and final/ of `model` take at their peak, beyond the resumed
    run's checkpoints already there (`peak_disk_bytes`)."""
    already = 0
    resumed_here = resume_from is not None and resume_from.parent.resolve() == output_dir.resolve()
    if resumed_here:
        step = checkpoint_step(resume_from)
        already = sum(
            1
            for p in list_checkpoints(output_dir)
            if step is not None and checkpoint_step(p) <= step
        )
    kept = checkpoints_kept(record)
    return peak_disk_bytes(
        model,
        checkpoints_kept=kept,
        already_saved=min(already, kept),
        # final/ holds full-precision weights, also where the base trained quantized.
        final_bytes=4 * sum(weights_held(p) for p in model.parameters()),
    )
