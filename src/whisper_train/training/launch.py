"""`--nproc N`: re-launch `whisper-train train` as N data-parallel processes on this machine.

The processes are started by torch.distributed's launcher (torchrun), which accelerate uses
underneath: one per GPU (NCCL), or CPU processes (gloo) where there is no GPU. Each one runs the
same recipe on its share of every batch (see `training.step.step_loss_weights`).

Under a launcher (`--nproc`, or torchrun on several nodes) the processes must see one run folder
(`check_shared_run_folder`), and when one of them is lost mid-run the others say which, which
checkpoint is kept and the command that continues on the nodes left (`lost_process_report`).
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
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


# -- the processes of a run on several nodes -----------------------------------------------------


@dataclass(frozen=True)
class Place:
    """This process's place in a launcher's run (torchrun's variables). torchrun numbers the
    nodes itself (GROUP_RANK: with a c10d rendezvous, --node-rank is ignored) and gives each
    node's processes consecutive ranks."""

    rank: int
    local_rank: int
    world: int  # processes in all
    local_world: int  # processes on each node
    node: int  # this node's number (GROUP_RANK)

    @classmethod
    def here(cls) -> Place:
        env = os.environ
        world = int(env.get("WORLD_SIZE", "1"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        rank = int(env.get("RANK", "0"))
        node = int(env.get("GROUP_RANK", str(rank // max(1, local_world))))
        return cls(rank, int(env.get("LOCAL_RANK", "0")), world, local_world, node)

    @property
    def nodes(self) -> int:
        return max(1, self.world // max(1, self.local_world))

    def node_of(self, rank: int) -> int:
        return rank // max(1, self.local_world)


def gather_from_processes(value: object) -> list:
    """`value` of every process of the run, in rank order (a collective: all must call it)."""
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def check_shared_run_folder(
    output_dir: Path, place: Place, gather: Callable[[object], list] = gather_from_processes
) -> list[str]:
    """Refuse the run before step 1 unless every process sees the folder process 0 writes in:
    each process writes its part of every checkpoint there (its random state, its place in a
    stream, its shard) and a --resume reads them all, so a node whose --output-dir is another
    folder or another disk would train until the first checkpoint and then fail, or leave
    checkpoints no resume can use. Process 0 writes a random mark; every process reads it
    back. Returns each process's host name (rank order), for what is said if one is lost.
    Every process must call this; `gather` is the collective (a test's stand-in)."""
    mark = output_dir / runfolder.SHARED_MARK_FILE
    if place.rank == 0:
        mark.write_text(secrets.token_hex(16), encoding="utf-8")
    gather(None)  # the mark is written before any process looks for it
    try:
        seen = mark.read_text(encoding="utf-8")
    except OSError:  # not there: another folder, another disk
        seen = None
    views = gather((socket.gethostname(), seen))
    if place.rank == 0:
        mark.unlink(missing_ok=True)  # every process has read it (they all reached the gather)
    hosts = [host for host, _ in views]
    blind = [rank for rank, (_, read) in enumerate(views) if read is None or read != views[0][1]]
    if not blind:
        return hosts
    where = "; ".join(
        ", ".join(str(rank) for rank in blind if hosts[rank] == host) + f" on {host}"
        for host in dict.fromkeys(hosts[rank] for rank in blind)
    )
    line = (
        f"--output-dir {output_dir}: process(es) {where} cannot see the files process 0 "
        f"({hosts[0]}) writes there; every process saves its part of each checkpoint in it "
        "and a --resume reads them all: give every node the same --output-dir, on a disk they "
        "all share (a network file system mounted at the same path)"
    )
    # Said once on each node, by its first process; the others stop without repeating it.
    raise UserError(line) if place.local_rank == 0 else AlreadySaid(line)


# How long a process that lost a peer waits for the others left to answer (`answering`): they
# learn of the loss within a collective's round trip, seconds at most.
ROLL_CALL_S = 3.0


def answering(place: Place, wait_s: float = ROLL_CALL_S) -> set[int] | None:
    """The processes of the run that answer a roll call within `wait_s` (this one among them),
    through the launcher's store (MASTER_ADDR:MASTER_PORT, which outlives the workers); None
    when it cannot be reached (it lived on the lost node). Bounded: never waits much longer
    than `wait_s` whatever the network does."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    keys = [f"whisper-train/answering/{restart}/{rank}" for rank in range(place.world)]
    found: list[set[int]] = []

    def call() -> None:
        try:
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timedelta(seconds=wait_s),
                wait_for_workers=False,
            )
            store.set(keys[place.rank], "1")
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and not store.check(keys):
                time.sleep(0.1)
            found.append({rank for rank, key in enumerate(keys) if store.check([key])})
        except Exception:  # no store, or it went away: the report says less
            return

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(2 * wait_s + 1)
    return found[0] if found else None


@dataclass(frozen=True)
class StepShape:
    """What a step trains, as the run's record has it (`record.data`)."""

    clips_per_step: int  # --batch-size x --gradient-accumulation x processes
    clips_per_micro_batch: int  # --batch-size
    accumulation: int  # --gradient-accumulation


def lost_process_report(
    place: Place,
    answered: set[int] | None,
    *,
    hosts: Sequence[str] | None,
    shape: StepShape,
    checkpoints_kept: Sequence[Path],
    argv: Sequence[str],
) -> list[str]:
    """What a process left says when a process of the run is gone: which, the checkpoint kept,
    and the command that continues on the nodes left at the same clips a step (so the run goes
    on exactly: see docs/multi-gpu.md, Resuming). Empty for all but the first process left on
    each node, which says it for its node. `answered`: the roll call (`answering`), None when
    it could not be held; `argv`: this command's arguments (`train ...`)."""
    if answered is None:  # nobody to ask: each node's first process speaks for this node alone
        if place.local_rank:
            return []
        lost_text, nodes_left = "another process of this run stopped answering", 1
    else:
        if place.rank != min(r for r in answered if place.node_of(r) == place.node):
            return []
        lost_text, nodes_left = _name_the_lost(place, answered, hosts)
    first = (
        f"error: {lost_text} (lost, or stopped by an error printed on its node); "
        f"process {place.rank} on node {place.node} stopped too"
    )
    if checkpoints_kept:
        kept, ending = (
            f"the last checkpoint is kept: {checkpoints_kept[-1]}",
            ["--resume", "latest"],
        )
    else:
        kept, ending = "no checkpoint was saved yet: the run starts again", ["--overwrite"]
    command, note = continuing_command(
        argv, nodes_left=nodes_left, local_world=place.local_world, shape=shape, ending=ending
    )
    where = "the node left" if nodes_left == 1 else f"each of the {nodes_left} nodes left"
    return [
        first,
        kept,
        f"continue on {where} at {shape.clips_per_step} clips a step{note}: {command}",
    ]


def _name_the_lost(
    place: Place, answered: set[int], hosts: Sequence[str] | None
) -> tuple[str, int]:
    """Which processes did not answer, by node ("node 1 on host-b (process 1)"), and how many
    nodes are left whole."""
    lost = [rank for rank in range(place.world) if rank not in answered]
    if not lost:  # every process answered: one stopped on an error of its own, said there
        return "a process of this run stopped", place.nodes
    nodes_answering = {place.node_of(rank) for rank in answered}
    named = []
    for node in sorted({place.node_of(rank) for rank in lost}):
        ranks = [rank for rank in lost if place.node_of(rank) == node]
        host = f" on {hosts[ranks[0]]}" if hosts else ""
        kind = "process(es) of node" if node in nodes_answering else "node"
        named.append(f"{kind} {node}{host} (process {', '.join(map(str, ranks))})")
    lost_nodes = {place.node_of(rank) for rank in lost} - nodes_answering
    return "; ".join(named) + " stopped answering", place.nodes - len(lost_nodes)


# Options the continuing command sets itself (with or without a value).
_REPLACED_VALUES = ("--resume", "--nproc", "--batch-size", "--gradient-accumulation")
_REPLACED_SWITCHES = ("--overwrite",)


def continuing_command(
    argv: Sequence[str],
    *,
    nodes_left: int,
    local_world: int,
    shape: StepShape,
    ending: Sequence[str],
) -> tuple[str, str]:
    """`whisper-train train ...` on `nodes_left` nodes of `local_world` processes, at the
    record's clips a step: its --batch-size (or, where none divides, --gradient-accumulation)
    chosen for the processes left; then `ending` (--resume latest). And a note when no setting
    keeps the clips a step ("" otherwise)."""
    args = list(argv) if argv and argv[0] == "train" else ["train", "..."]
    kept: list[str] = []
    skip = False
    for arg in args:
        name = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif name in _REPLACED_SWITCHES:
            continue
        elif name in _REPLACED_VALUES:
            skip = "=" not in arg
        else:
            kept.append(arg)
    processes = nodes_left * local_world
    batch, accumulation = shape.clips_per_micro_batch, shape.accumulation
    note = ""
    if shape.clips_per_step % (accumulation * processes) == 0:
        batch = shape.clips_per_step // (accumulation * processes)
    elif shape.clips_per_step % (batch * processes) == 0:
        accumulation = shape.clips_per_step // (batch * processes)
    else:
        batch = max(1, shape.clips_per_step // (accumulation * processes))
        note = f" (no --batch-size keeps it on {processes} processes: the epoch is planned anew)"
    step_flags = ["--batch-size", str(batch)]
    if accumulation != 1:
        step_flags += ["--gradient-accumulation", str(accumulation)]
    if nodes_left == 1:
        nproc = ["--nproc", str(local_world)] if local_world > 1 else []
        return shlex.join(["whisper-train", *kept, *nproc, *step_flags, *ending]), note
    launcher = ["torchrun", f"--nnodes={nodes_left}", f"--nproc-per-node={local_world}"]
    command = shlex.join([*launcher, "-m", "whisper_train", *kept, *step_flags, *ending])
    return command, note + " (with the same --rdzv-* options as before)"


if __name__ == "__main__":
    sys.exit(_torchrun(sys.argv[1:]))
