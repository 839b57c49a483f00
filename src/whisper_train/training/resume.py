"""Resuming a run, the policy (which checkpoint `--resume` continues from is
`checkpoints.find_resume`'s): what a checkpoint saved before runs kept records may
be resumed with (`check_recordless_options`, `convert_position`), what a resume changes taking
effect (`restore_from`: the checkpoint loaded, then this run's learning rates and weight decay
applied), and the run folder tidied to the resume point (later checkpoints set aside,
metrics.jsonl cut back). What a checkpoint holds, and reading it, is `checkpoints`'; what a
resume may change is decided by the records (`config.record.resume_changes`).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from whisper_train.config import field_owners
from whisper_train.config.options import NONSPEECH_AUTO, PACKING_AUTO
from whisper_train.config.record import (
    MUST_EQUAL,
    REPLANS,
    SLICES,
    RunRecord,
    flag_of,
    options_recorded,
    same_path,
)
from whisper_train.config.resolve import SavedChoices
from whisper_train.errors import UserError
from whisper_train.runfolder import ABANDONED_PREFIX, METRICS_FILE
from whisper_train.training.checkpoints import (
    TrainerState,
    checkpoint_folders,
    checkpoint_step,
)
from whisper_train.training.checkpoints.load import load_checkpoint, saved_record

# -- a checkpoint saved before runs kept records ----------------------------------------------


def check_recordless_options(folder: Path, options: dict, config) -> None:
    """A checkpoint saved before runs kept records: the options whose record fields an exact
    resume depends on (`MUST_EQUAL`, and `REPLANS`, which needs the checkpoint's plan) must
    equal its saved ones; the first that differs is refused in one line."""
    classes = {f.name: f.metadata["resume"] for kind in SLICES.values() for f in fields(kind)}
    for option, recorded in options_recorded().items():
        if not any(classes[name.split(".")[1]] in (MUST_EQUAL, REPLANS) for name in recorded):
            continue
        group = field_owners()[option]
        if option not in options.get(group, {}):
            continue
        before, now = options[group][option], getattr(getattr(config, group), option)
        if option == "data" and before and now and same_path(before, now):
            continue
        if (option, now) in (("packing", PACKING_AUTO), ("nonspeech", NONSPEECH_AUTO)):
            continue  # auto takes the checkpoint's (`config.resolve.choose_packing`)
        if before != now:
            flag = flag_of(option)
            raise UserError(
                f"--resume {folder}: {flag} {now} differs from the checkpoint's {before}, and "
                f"an exact resume depends on it; resume with {flag} {before}, or start a new run "
                "(a new --output-dir) to change it"
            )


def saved_choices(saved: RunRecord | None, options: dict) -> SavedChoices:
    """What a checkpoint chose where auto may be asked again: from its record, or, for a
    record-less checkpoint, from its saved options (that version wrote --packing auto's
    choice there, and had no --nonspeech auto)."""
    if saved is not None:
        return SavedChoices.of(saved)
    packing = options.get("data", {}).get("packing")
    return SavedChoices(
        None if packing in (None, PACKING_AUTO) else str(packing),
        options.get("data", {}).get("nonspeech"),
        options.get("data", {}).get("nonspeech_share"),
    )


def convert_position(state: TrainerState, folder: Path) -> None:
    """A record-less checkpoint's place in its epoch, in micro-batches consumed, as steps: its
    run planned unpacked steps as this version does (--gradient-accumulation micro-batches of
    --batch-size clips), so steps = micro-batches / accumulation; a packed run planned its
    steps otherwise, and is refused (`saved_record`'s options say which)."""
    _, options = saved_record(folder)
    train = options.get("train", {})
    if options.get("data", {}).get("packing", "off") not in ("off", False):
        raise UserError(
            f"--resume {folder}: it was saved by an earlier whisper-train, which planned a "
            "packed run's steps otherwise; resume it with that version, or start a new run"
        )
    accumulation = max(1, int(train.get("gradient_accumulation", 1)))
    state.steps_in_epoch = state.batches_in_epoch // accumulation


# -- what a resume changes, taking effect -----------------------------------------------------


def restore_from(folder: Path, *, accelerator, model, optimizer, scheduler) -> TrainerState:
    """Checkpoint `folder` loaded (`checkpoints.load_checkpoint`), then what this run may
    change applied from the resume point: the optimizer's groups keep this run's weight decay
    (`optimizer.load_state_dict` restores the checkpoint's) and the schedule this run's base
    learning rates (`_apply_new_learning_rate`)."""
    # This run's base learning rates (its --learning-rate) and weight decay, before the
    # checkpoint's replace them.
    new_base_lrs = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
    new_decay = [group["weight_decay"] for group in optimizer.param_groups]
    state = load_checkpoint(
        folder, accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler
    )
    # A resume on another number of processes: this run's checkpoints hold its own processes'
    # random states (`find_damage` expects an rng-<rank>.pt for each).
    state.world_size = accelerator.num_processes
    _apply_new_learning_rate(optimizer, scheduler, new_base_lrs)
    for group, decay in zip(optimizer.param_groups, new_decay, strict=True):
        group["weight_decay"] = decay
    return state


def _apply_new_learning_rate(optimizer, scheduler, new_base_lrs: list[float]) -> None:
    """After loading, the scheduler holds the checkpoint's base learning rates; a --resume with
    another --learning-rate scales each group from this step on: the schedule keeps its shape
    (warmup, decay) and the rate at step s becomes the new base times the schedule at s."""
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate wraps the scheduler
    if not hasattr(inner, "base_lrs") or list(inner.base_lrs) == list(new_base_lrs):
        return
    for index, (group, old, new) in enumerate(
        zip(optimizer.param_groups, inner.base_lrs, new_base_lrs, strict=True)
    ):
        scale = new / old if old else 0.0
        group["lr"] = group["lr"] * scale if old else new
        group["initial_lr"] = new
        inner.base_lrs[index] = new
    inner._last_lr = [group["lr"] for group in optimizer.param_groups]


# -- the run folder at the resume point ----------------------------------------------------


def set_aside_later_checkpoints(output_dir: Path, step: int) -> Path | None:
    """Move the checkpoints after `step` (of the run a resume from `step` abandons, or damaged
    ones it skipped) into OUTPUT/abandoned-after-step-<step>/, with their rows of
    metrics.jsonl: they would otherwise count as the newest (`--resume latest`, rotation).
    Nothing is deleted. Returns that folder, None when there was nothing to move."""
    # Only checkpoint-<step> folders count as checkpoints: a `.tmp` one (an interrupted write)
    # is removed when this run saves that step, as after any crash.
    later = [p for p in checkpoint_folders(output_dir) if checkpoint_step(p) > step]
    if not later:
        return None
    aside, n = output_dir / f"{ABANDONED_PREFIX}{step}", 2
    while aside.exists():
        aside, n = output_dir / f"{ABANDONED_PREFIX}{step}-{n}", n + 1
    aside.mkdir()
    for folder in later:
        folder.rename(aside / folder.name)
    truncate_metrics(output_dir / METRICS_FILE, step, dropped_to=aside / METRICS_FILE)
    return aside


def truncate_metrics(metrics_file: Path, step: int, *, dropped_to: Path | None = None) -> None:
    """Drop metrics lines past `step`, so a resumed run's file reads like one run; with
    `dropped_to`, the rows past `step` are written there instead of lost."""
    if not metrics_file.is_file():
        return
    kept, dropped = [], []
    for line in metrics_file.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # half a line: the crash came while it was being written
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            kept.append(line)
        else:
            dropped.append(line)
    if dropped_to is not None:
        if not dropped:
            return
        dropped_to.write_text("".join(line + "\n" for line in dropped), encoding="utf-8")
    metrics_file.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
