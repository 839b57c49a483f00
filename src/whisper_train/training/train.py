"""`train(config)`: check the run folder, then run the fine-tuning recipe here or in N processes.

The recipe itself (setup, the loop, evaluation, checkpoints, the final model) is
`recipe.FineTuneRecipe`; `--nproc N` re-launches this command as N processes (`launch`), each of
which runs the recipe on its share of every batch.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch.distributed
from tqdm.auto import tqdm

from whisper_train import runfolder
from whisper_train.config.run import RunConfig
from whisper_train.errors import AlreadySaid, UserError, last_line
from whisper_train.formats.packaged import resolve_alias
from whisper_train.runlog import TrainResult
from whisper_train.trackers import check_installed
from whisper_train.training import checkpoints
from whisper_train.training.launch import (
    Place,
    StepShape,
    answering,
    check_shared_run_folder,
    claimed_by_parent,
    inside_launcher,
    launch_data_parallel,
    lost_process_report,
)

__all__ = ["TrainResult", "exit_keeping_process_group", "holds_process_group", "train"]

# What holds this process's group in a multi-process run (its state, then the recipe whose DDP
# reducer or FSDP state holds it too): kept until the process exits (`exit_keeping_process_group`).
_KEPT_UNTIL_EXIT: list = []


def train(config: RunConfig) -> TrainResult:
    """Fine-tune per `config`; with `--nproc N` (outside a launcher) re-launch as N processes."""
    config.validate()
    check_installed(config.train.report_to)  # a missing tracker package: before anything loads
    if not config.data.data:
        raise UserError("--data is required: a folder with metadata.csv, or a JSONL/CSV manifest")
    output_dir = Path(config.train.output_dir)
    runfolder.check_writable(output_dir)
    if claimed_by_parent(output_dir) or int(os.environ.get("RANK", "0")) != 0:
        # A process of a run whose launching process (--nproc) or process 0 (an outside
        # launcher) holds the folder's lock: all of them are one run.
        return _train_in(config, None)
    with runfolder.RunLock(output_dir) as lock:  # before the folder is claimed, until the end
        return _train_in(config, lock)


def _train_in(config: RunConfig, lock: runfolder.RunLock | None) -> TrainResult:
    output_dir = Path(config.train.output_dir)
    if not claimed_by_parent(output_dir):
        # Refuse an earlier run's folder, or move it aside. What a --resume may change is
        # decided in each process once its record is made (`config.record.resume_changes`).
        claim_output_dir(config)
    if config.train.nproc > 1 and not inside_launcher():
        return launch_data_parallel(config, lock)
    # Imported here, not above: a process that launches --nproc workers never builds a model,
    # and transformers, peft and the recipe's other libraries take it 4-5 s of a CPU to import
    # (measured: `python -X importtime`), before each of its workers pays them again.
    from whisper_train.training.recipe import FineTuneRecipe

    hosts = meet_in_run_folder(output_dir) if inside_launcher() else None
    recipe = FineTuneRecipe(config)
    if inside_launcher():
        _KEPT_UNTIL_EXIT.append(recipe)
    try:
        recipe.setup()
        recipe.train()
        return recipe.finish()
    except RuntimeError as exc:
        if not (inside_launcher() and lost_another_process(exc)):
            raise
        # A traceback here says nothing about the cause, which is in the other process's
        # error (or in its death: the launcher names the signal that killed it).
        if claimed_by_parent(output_dir):  # --nproc: the launching process names the cause
            rank = os.environ.get("RANK", "?")
            raise UserError(
                f"process {rank}: another process of this run stopped or was killed "
                f"({last_line(exc)}); this one stopped too"
            ) from None
        say_what_was_lost(config, getattr(recipe, "record", None), hosts)
        raise AlreadySaid("a process of this run was lost") from None


def meet_in_run_folder(output_dir: Path) -> list[str] | None:
    """Join the run's processes (the process group: `setup_phases.join_processes`) and check,
    before step 1, that they all see one run folder (`launch.check_shared_run_folder`): each
    process's host name, in rank order (None for a run of one process)."""
    from whisper_train.training.setup_phases import join_processes

    process = join_processes()
    _KEPT_UNTIL_EXIT.append(process)
    if process.num_processes == 1:
        return None
    return check_shared_run_folder(output_dir, Place.here())


def say_what_was_lost(config: RunConfig, record, hosts: list[str] | None) -> None:
    """A process of a run on several nodes lost a peer mid-run: the first process left on each
    node says which was lost, the checkpoint kept and the command that continues on the nodes
    left (`launch.lost_process_report`); the others say nothing."""
    place = Place.here()
    if record is not None:
        data = record.data
        shape = StepShape(data.clips_per_step, data.clips_per_micro_batch, data.accumulation)
    else:  # lost before the record was made: what was asked
        t = config.train
        shape = StepShape(
            t.batch_size * t.gradient_accumulation * place.world,
            t.batch_size,
            t.gradient_accumulation,
        )
    lines = lost_process_report(
        place,
        answering(place),
        hosts=hosts,
        shape=shape,
        checkpoints_kept=checkpoints.list_checkpoints(Path(config.train.output_dir)),
        argv=sys.argv[1:],
    )
    for line in lines:
        print(line, file=sys.stderr, flush=True)


def holds_process_group() -> bool:
    """True when this process ran a multi-process run's recipe (it keeps its group)."""
    return bool(_KEPT_UNTIL_EXIT)


def exit_keeping_process_group(code: int) -> None:
    """End this process with `code` at once when it ran a multi-process run's recipe (else
    return): output flushed, nothing torn down (the kernel closes the group's sockets). The
    run's files are written and closed by now: a finished run's processes all passed its last
    barrier, a stopped one's saved their checkpoint, a failed one's others are stopped by the
    launcher.

    The process group's last owner is DDP's reducer: freed with the recipe, under the GIL, it
    destroyed the group, whose destructor joins gloo's worker threads. A worker that had not
    yet let go of its last collective (the final NaN check's all-reduce, whose tensor's Python
    object the caller had dropped: freeing it takes the GIL) then waited for the GIL for ever,
    and the process never exited (~ProcessGroupGloo joining a thread in take_gil: 2 of 31
    runs of `--nproc 2` on a loaded 2-core machine; a race of the last collective's release
    against the teardown, whatever the data). Not destroying the group removes the wait; a
    timeout would only bound it.
    """
    if not holds_process_group():
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# What a collective raises when a process of the run is gone: gloo's socket errors; NCCL's
# communicator aborted (torch.distributed.DistError covers its backend and network errors).
_LOST_PROCESS_SIGNS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Connection refused",
    "Broken pipe",
    "Socket closed",
    "NCCL communicator was aborted",
)


def lost_another_process(exc: BaseException) -> bool:
    """True when `exc` is a collective's failure because a process of the run went away."""
    text = str(exc)
    return isinstance(exc, torch.distributed.DistError) or any(
        sign in text for sign in _LOST_PROCESS_SIGNS
    )


def claim_output_dir(config: RunConfig) -> None:
    """Refuse to train over an earlier run in --output-dir (`runfolder.RUN_ENTRIES`) unless told
    to --resume or --overwrite it; with --overwrite, move its whisper-train files aside first.

    Call once per run, before anything is written: before `--nproc` re-launches the command
    (its workers skip this), and, under an outside launcher, in every process before they meet
    (each sees the folder as it was; only the first moves anything).
    """
    t = config.train
    output_dir = Path(t.output_dir)
    entries = runfolder.run_entries(output_dir)
    if not entries:
        return  # a new, empty, or someone else's folder: their files are left alone
    if t.resume:
        resume_from = checkpoints.resolve_resume(t.resume, output_dir)
        if resume_from.parent.resolve() != output_dir.resolve():
            raise UserError(
                f"--resume {t.resume}: that checkpoint is not in --output-dir {output_dir}, which "
                "holds another run that resuming would replace; choose an empty --output-dir"
            )
        return
    names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in entries[:4])
    names += ", ..." if len(entries) > 4 else ""
    if not t.overwrite:
        continuing = (
            "add --resume latest to continue it"
            if checkpoints.list_checkpoints(output_dir)
            else "it has no checkpoint to --resume from"
        )
        raise UserError(
            f"--output-dir {output_dir} holds an earlier run ({names}); {continuing}, add "
            "--overwrite to move it aside and start afresh, or choose another --output-dir"
        )
    # Fine-tuning the earlier run's own model further: moving it aside first would lose it.
    model_path = Path(resolve_alias(config.model.model)).expanduser().resolve()
    moved = [entry.resolve() for entry in entries]
    if model_path == output_dir.resolve() or any(
        model_path == entry or entry in model_path.parents for entry in moved
    ):
        raise UserError(
            f"--model {config.model.model} is part of the run in --output-dir {output_dir}, "
            "which --overwrite would move aside; train into another --output-dir"
        )
    if int(os.environ.get("RANK", "0")) == 0:
        aside = runfolder.move_aside(output_dir, entries)
        tqdm.write(f"--overwrite: moved the earlier run's files ({names}) to {aside}")
