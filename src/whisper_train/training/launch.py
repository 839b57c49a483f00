"""`--nproc N`: re-launch `whisper-train train` as N data-parallel processes on this machine.

The processes are started by torch.distributed's launcher (torchrun), which accelerate uses
underneath: one per GPU (NCCL), or CPU processes (gloo) where there is no GPU. Each one runs the
same recipe on its share of every batch (see `training.step.step_loss_weights`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from whisper_train import runfolder
from whisper_train.config.run import RunConfig
from whisper_train.errors import AlreadySaid, UserError
from whisper_train.runlog import StopRequest, TrainingInterrupted, TrainResult, read_result
from whisper_train.training import checkpoints

# Set for the worker processes: the parent already checked (and, with --overwrite, cleared) the
# output folder, so the workers must not refuse their own run.
CLAIMED_ENV = "WHISPER_TRAIN_CLAIMED_OUTPUT_DIR"
# Exit codes of a run stopped by SIGINT / SIGTERM after a checkpoint (`TrainingInterrupted`).
STOPPED_CODES = tuple(128 + signum for signum in StopRequest.SIGNALS)
# The exit code of a process that stopped on a user error, its one line printed (`cli.main`).
USER_ERROR_CODE = 2


def inside_launcher() -> bool:
    """True in a process started by torchrun / accelerate launch (they set LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def claimed_by_parent(output_dir: Path) -> bool:
    """True in a worker of `launch_data_parallel`, whose parent claimed `output_dir`."""
    return os.environ.get(CLAIMED_ENV) == str(output_dir.resolve())


def launch_data_parallel(config: RunConfig, lock: runfolder.RunLock | None = None) -> TrainResult:
    """Run `config` as `config.train.nproc` processes and wait for them.

    If one process dies, the launcher stops the others and this call raises instead of waiting;
    SIGINT / SIGTERM are passed on, so the workers save a checkpoint before they exit. `lock`
    (the output folder's, held by this process) is inherited by torchrun too: a launcher killed
    outright leaves torchrun and its workers running, and the folder stays theirs until they end.
    """
    n = config.train.nproc
    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        raise UserError(
            f"--nproc {n}: only {torch.cuda.device_count()} GPU(s) visible; use --nproc "
            f"{torch.cuda.device_count()} or fewer"
        )
    output_dir = Path(config.train.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    launch_config = output_dir / runfolder.LAUNCH_FILE
    launch_config.write_text(config.to_yaml(), encoding="utf-8")
    (output_dir / runfolder.RESULT_FILE).unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "whisper_train.training.launch",  # torchrun (`_torchrun` below)
        "--standalone",
        f"--nproc-per-node={n}",
        "-m",
        "whisper_train",
        "train",
        "--config",
        str(launch_config),
    ]
    env = dict(os.environ)
    env[CLAIMED_ENV] = str(output_dir.resolve())
    # Two processes on one CPU must not each take every core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    inherited = (lock.fd,) if lock is not None and lock.fd is not None else ()
    # torchrun in a session of its own: Ctrl-C at a terminal signals the whole foreground
    # group, and torchrun, which also gets the signal passed on below, took the second one
    # for a new shutdown in the middle of the first. Its workers have sessions of their own.
    process = subprocess.Popen(command, env=env, pass_fds=inherited, start_new_session=True)
    received = []

    def forward(signum, frame):  # the workers save a checkpoint and exit; wait for them
        received.append(signum)
        process.send_signal(signum)

    # SIGHUP too (a closed terminal): torchrun, out of the terminal's session, would not get it.
    forwarded = (*StopRequest.SIGNALS, signal.SIGHUP)
    previous = {s: signal.signal(s, forward) for s in forwarded}
    try:
        code = process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        raise TrainingInterrupted(128 + received[0])
    if code in STOPPED_CODES:  # the workers were signalled themselves (a scheduler's SIGTERM)
        raise TrainingInterrupted(code)
    if code > 128:  # a worker was killed: it printed nothing; the others said they stopped
        found = checkpoints.list_checkpoints(output_dir)
        then = (
            f"continue from {found[-1]} with --resume latest"
            if found
            else "no checkpoint was saved: start again with --overwrite"
        )
        raise UserError(
            f"--nproc {n}: a training process was killed by {_signal_name(code - 128)} (the "
            f"out-of-memory killer sends SIGKILL) and the run stopped; {then}"
        )
    if code == USER_ERROR_CODE:  # a process printed the one line that says why
        raise AlreadySaid(f"--nproc {n}: a training process stopped with the error printed above")
    if code != 0:
        raise UserError(
            f"--nproc {n}: a training process failed (exit code {code}); its error is printed above"
        )
    return read_result(output_dir)


def _torchrun(argv: list[str]) -> int:
    """torchrun on `argv`, saying nothing of its own: the workers say what happened.

    When a worker fails, torchrun raises ChildFailedError: a launcher traceback and a report
    table after the worker's own one-line error. Each worker has printed its error already
    (every process learns of a failure: see checkpoints.save_checkpoint), so the launcher only
    passes the failure on as its exit code: 130 / 143 when every worker stopped for SIGINT /
    SIGTERM (they saved and printed the resume command), else 1. When torchrun itself is
    signalled it passes the signal to the workers, waits for them (they save), logs warnings
    and raises SignalException (40-odd lines of traceback): the exit code 128 + signal instead.
    """
    # torchrun's loggers set their own level (WARNING) when created: quiet each one ("Received
    # 2 death signal, shutting down workers", "Sending process N closing signal", "failed
    # (exitcode: -9) local_rank: 1"): the workers' lines and the launcher's say it in words.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        # A worker killed outright (SIGKILL: the out-of-memory killer) is the cause whenever one
        # was: the others only stopped after it, but torchrun may see them gone in the same
        # poll, and its "first" failure is then either (on a loaded machine, the one that
        # stopped at once was taken for the cause, and the kill was never said).
        if any(f.exitcode == -signal.SIGKILL for f in exc.failures.values()):
            return 128 + signal.SIGKILL
        _, first = exc.get_first_failure()  # the cause; torchrun then stopped the others
        if first.exitcode < 0:  # -N: killed by signal N
            return 128 - first.exitcode
        if first.exitcode == USER_ERROR_CODE:  # it printed its one line
            return USER_ERROR_CODE
        codes = {failure.exitcode for failure in exc.failures.values()}
        return codes.pop() if len(codes) == 1 and codes <= set(STOPPED_CODES) else 1
    return 0


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


if __name__ == "__main__":
    sys.exit(_torchrun(sys.argv[1:]))
