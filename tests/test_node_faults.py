"""Faults of a run on several nodes, on one machine: two launches meeting at a c10d rendezvous
(test_nodes), one of them killed outright mid-run (its launcher and its worker, as a node that
loses power), or given another --output-dir (a node that does not share the run folder).

The lost node: the node left stops in seconds with whisper-train's three lines (which node,
the checkpoint kept, the command that continues on the node left), and that command, run as
printed, continues the run as one process at the same clips a step: every step's loss equals
the uninterrupted run's within 1e-4 (the resume on another process count of
test_resume_processes).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from datetime import timedelta

import numpy as np
import psutil
import pytest
import torch.distributed as dist
from conftest import (
    SAME_RUN_LOSS_ATOL,
    TRAIN_SUBPROCESS_TIMEOUT_S,
    metric_rows,
    train_argv,
    write_tone_dataset,
)
from test_nodes import free_port, torchrun_node
from test_resume_processes import FLAGS as EXACT_RUN_FLAGS

from whisper_train import runfolder
from whisper_train.cli import main
from whisper_train.errors import AlreadySaid, UserError
from whisper_train.training import launch
from whisper_train.training.checkpoints import checkpoint_step, list_checkpoints
from whisper_train.training.launch import Place, StepShape

# 16 clips, 4 a step (2 nodes x batch 2): 4 steps an epoch; a checkpoint every 2 steps. The
# node is killed once checkpoint-2 is complete, and the run has steps enough left (about half
# a second each here) that the kill lands before it ends; the resumed part crosses an epoch.
STEPS = 8
FLAGS = [*EXACT_RUN_FLAGS, f"--max-steps={STEPS}", "--save-steps=2"]
# Each node is started through whisper-train's launcher (torchrun's options, without torchrun's
# own traceback when its process fails: docs/multi-gpu.md), so what the node left prints is
# whisper-train's alone.
LAUNCHER = "whisper_train.training.launch"
# The node left must stop within this (measured here: about 4 s, 3 of them the roll call).
LOST_NODE_EXIT_S = 60


def start_nodes(flags_of_node: list[list[str]]) -> list[subprocess.Popen]:
    """Two nodes, each in a session of its own (so that one can be killed whole); node 0 first,
    so that it hosts the rendezvous (and its store) that node 1 then joins."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    port = free_port()
    nodes = []
    for rank, flags in enumerate(flags_of_node):
        if rank:
            wait_for_listener(port, nodes[0])
        nodes.append(
            subprocess.Popen(
                torchrun_node(rank, port, flags, launcher=LAUNCHER),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return nodes


def wait_for_listener(port: int, node: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and node.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("node 0's rendezvous never listened")


def kill_node(node: subprocess.Popen) -> None:
    """SIGKILL a node whole: its launcher and every process under it (torchrun starts each
    worker in a session of its own, so the launcher's group alone would leave the worker
    training), then wait until all of them are gone."""
    launcher_process = psutil.Process(node.pid)
    workers = launcher_process.children(recursive=True)
    assert any("whisper_train" in " ".join(w.cmdline()) for w in workers), "no worker to kill"
    os.killpg(node.pid, signal.SIGKILL)
    for worker in workers:
        worker.kill()
    _, alive = psutil.wait_procs([launcher_process, *workers], timeout=30)
    assert not alive, f"still running after SIGKILL: {alive}"


def stop_all(nodes: list[subprocess.Popen]) -> None:
    for node in nodes:
        if node.poll() is None:
            for process in [*psutil.Process(node.pid).children(recursive=True)]:
                process.kill()
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()


def losses(folder) -> list[float]:
    return [row["loss"] for row in metric_rows(folder) if "loss" in row]


def kill_node_1_after_a_checkpoint(nodes, run) -> tuple[str, float]:
    """Once `run` holds a complete checkpoint, node 1 killed whole: (node 0's output, seconds
    from the kill until node 0 exited). Every node is stopped on the way out."""
    try:
        deadline = time.monotonic() + TRAIN_SUBPROCESS_TIMEOUT_S
        while not list_checkpoints(run):
            assert time.monotonic() < deadline and nodes[0].poll() is None, "no checkpoint"
            time.sleep(0.05)
        kill_node(nodes[1])
        killed = time.monotonic()
        output = nodes[0].communicate(timeout=TRAIN_SUBPROCESS_TIMEOUT_S)[0]
        return output, time.monotonic() - killed
    finally:
        stop_all(nodes)


@pytest.mark.long
def test_a_node_killed_mid_run_is_named_and_its_command_continues_exactly(
    tmp_path, tiny_whisper_dir, capsys
):
    data = write_tone_dataset(tmp_path / "data", n=16)
    run = tmp_path / "run"
    flags = train_argv(data, tiny_whisper_dir, run, *FLAGS, "--batch-size=2")[1:]
    nodes = start_nodes([flags, flags])
    output, stopped_after = kill_node_1_after_a_checkpoint(nodes, run)
    assert nodes[0].returncode != 0, output[-3000:]
    assert stopped_after < LOST_NODE_EXIT_S, stopped_after
    kept = list_checkpoints(run)[-1]
    assert checkpoint_step(kept) < STEPS  # the kill landed mid-run
    # After the step lines, whisper-train's three lines, once, and nothing else (no traceback).
    said = [line for line in output.splitlines() if line.strip()]
    last_step = max(i for i, line in enumerate(said) if re.match(r"(step \d+/|checkpoint:)", line))
    assert said[last_step + 1 :] == [
        "error: node 1 on "
        f"{socket.gethostname()} (process 1) stopped answering (lost, or stopped by an error "
        "printed on its node); process 0 on node 0 stopped too",
        f"the last checkpoint is kept: {kept}",
        said[-1],
    ], output[-3000:]
    advice = re.fullmatch(
        r"continue on the node left at 4 clips a step: (whisper-train .*)", said[-1]
    )
    assert advice, said[-1]
    command = shlex.split(advice.group(1))
    assert command[-4:] == ["--batch-size", "4", "--resume", "latest"]

    # The command, as printed, on the node left: one process at batch 4 from the checkpoint kept.
    capsys.readouterr()
    assert main(command[1:]) == 0
    resumed = capsys.readouterr().out
    assert f"--resume: processes 2 -> 1 from step {checkpoint_step(kept) + 1} on" in resumed
    rows = [row for row in metric_rows(run) if "loss" in row]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    # The run uninterrupted: one process at batch 4 from the start.
    whole = tmp_path / "whole"
    assert main(train_argv(data, tiny_whisper_dir, whole, *FLAGS, "--batch-size=4")) == 0
    np.testing.assert_allclose(losses(run), losses(whole), rtol=0, atol=SAME_RUN_LOSS_ATOL)


@pytest.mark.long
def test_nodes_that_do_not_share_the_run_folder_are_refused_before_step_1(
    tmp_path, tiny_whisper_dir
):
    """The command line lets each node name its own --output-dir: node 1 naming another folder
    is a node that does not share node 0's disk. Today's alternative was to train until the
    first checkpoint and fail there (each process writes its part of it)."""
    data = write_tone_dataset(tmp_path / "data", n=8)
    folders = [tmp_path / "node0", tmp_path / "node1"]
    nodes = start_nodes(
        [train_argv(data, tiny_whisper_dir, f, *FLAGS, "--batch-size=2")[1:] for f in folders]
    )
    try:
        outputs = [node.communicate(timeout=TRAIN_SUBPROCESS_TIMEOUT_S)[0] for node in nodes]
    finally:
        stop_all(nodes)
    for node, folder, output in zip(nodes, folders, outputs, strict=True):
        assert node.returncode == 2, output[-3000:]
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert errors == [
            f"error: --output-dir {folder}: process(es) 1 on {socket.gethostname()} cannot see "
            f"the files process 0 ({socket.gethostname()}) writes there; every process saves its "
            "part of each checkpoint in it and a --resume reads them all: give every node the "
            "same --output-dir, on a disk they all share (a network file system mounted at the "
            "same path)"
        ], output[-3000:]
        assert "step 1/" not in output and "Traceback" not in output
        assert not list(folder.glob("*")) if folder.exists() else True  # nothing written


# -- the pieces, without processes ---------------------------------------------------------------


def gather_between_threads(n: int):
    """An all-gather between `n` threads (each a process of the run): the collective the check
    runs, without a process group."""
    barrier, slots = threading.Barrier(n), {}

    def gather_for(rank: int):
        def gather(value):
            slots[rank] = value
            barrier.wait(timeout=10)
            values = [slots[r] for r in range(n)]
            barrier.wait(timeout=10)  # all have read before a later gather writes
            return values

        return gather

    return gather_for


def check_from_threads(folders, local_ranks):
    """check_shared_run_folder in one thread a process, process r in folders[r]: what each
    returned or raised."""
    gather_for, results = gather_between_threads(len(folders)), {}

    def run(rank):
        place = Place(rank, local_ranks[rank], len(folders), 1, rank)
        try:
            results[rank] = launch.check_shared_run_folder(folders[rank], place, gather_for(rank))
        except UserError as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(folders))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return [results[rank] for rank in range(len(folders))]


def test_a_process_that_cannot_see_the_run_folder_refuses_the_run_everywhere(tmp_path):
    shared, other = tmp_path / "shared", tmp_path / "other"
    shared.mkdir()
    other.mkdir()
    # Process 1 sees another folder: every process refuses; the first on each node says it.
    results = check_from_threads([shared, other, shared], local_ranks=[0, 0, 1])
    assert [type(r) for r in results] == [UserError, UserError, AlreadySaid]
    assert str(results[0]) == str(results[2])
    assert "process(es) 1 on" in str(results[0]) and "a disk they all share" in str(results[0])
    # One folder: the run goes on, and the mark is gone.
    hosts = check_from_threads([shared, shared, shared], local_ranks=[0, 0, 1])
    assert hosts == [[socket.gethostname()] * 3] * 3
    assert not (shared / runfolder.SHARED_MARK_FILE).exists()
    # A mark left from an earlier start is not taken for this one's.
    (other / runfolder.SHARED_MARK_FILE).write_text("an earlier run's", encoding="utf-8")
    results = check_from_threads([shared, other], local_ranks=[0, 0])
    assert all(isinstance(r, UserError) for r in results)


TRAIN_ARGV = ["train", "--data", "d", "--batch-size=2", "--overwrite", "--resume", "x", "-v"]


@pytest.mark.parametrize(
    ("place", "answered", "shape", "said"),
    [
        # 2 nodes x 1 process, node 1 lost: one process at twice the batch.
        (
            Place(0, 0, 2, 1, 0),
            {0},
            StepShape(4, 2, 1),
            "continue on the node left at 4 clips a step: whisper-train train --data d -v "
            "--batch-size 4 --resume latest",
        ),
        # 2 nodes x 2 processes: --nproc 2 on the node left.
        (
            Place(2, 0, 4, 2, 1),
            {2, 3},
            StepShape(8, 2, 1),
            "continue on the node left at 8 clips a step: whisper-train train --data d -v "
            "--nproc 2 --batch-size 4 --resume latest",
        ),
        # 3 nodes, one lost: torchrun on the two left; 6 clips over 2 processes at
        # accumulation 2 is no whole batch, so the accumulation gives way.
        (
            Place(0, 0, 3, 1, 0),
            {0, 1},
            StepShape(6, 1, 2),
            "continue on each of the 2 nodes left at 6 clips a step (with the same --rdzv-* "
            "options as before): torchrun --nnodes=2 --nproc-per-node=1 -m whisper_train train "
            "--data d -v --batch-size 1 --gradient-accumulation 3 --resume latest",
        ),
    ],
)
def test_the_node_left_says_what_was_lost_and_the_command_that_keeps_the_step(
    tmp_path, place, answered, shape, said
):
    kept = [tmp_path / "checkpoint-2", tmp_path / "checkpoint-4"]
    lines = launch.lost_process_report(
        place, answered, hosts=["a", "a", "b", "b"], shape=shape, checkpoints_kept=kept,
        argv=TRAIN_ARGV,
    )  # fmt: skip
    assert lines[1:] == [f"the last checkpoint is kept: {kept[-1]}", said]
    assert lines[0].startswith("error: node ")


def test_only_the_first_process_left_on_a_node_speaks(tmp_path):
    shape, argv = StepShape(8, 2, 1), TRAIN_ARGV
    report = [
        launch.lost_process_report(
            Place(rank, rank % 2, 4, 2, rank // 2), {1, 2, 3}, hosts=None, shape=shape,
            checkpoints_kept=[], argv=argv,
        )
        for rank in (1, 2, 3)
    ]  # fmt: skip
    assert [bool(lines) for lines in report] == [True, True, False]
    # Process 0 alone is gone, its node is not: the nodes left are both, and nothing was kept.
    assert report[0][0].startswith("error: process(es) of node 0 (process 0) stopped answering")
    assert report[0][1] == "no checkpoint was saved yet: the run starts again"
    assert "torchrun --nnodes=2 --nproc-per-node=2" in report[0][2]
    assert report[0][2].endswith("--batch-size 2 --overwrite")


def test_the_roll_call_counts_the_processes_that_answer_and_gives_up_on_no_store(monkeypatch):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5))
    store.set("whisper-train/answering/0/2", "1")  # process 2 answered; process 1 is lost
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    started = time.monotonic()
    assert launch.answering(Place(0, 0, 3, 1, 0), wait_s=0.5) == {0, 2}
    assert time.monotonic() - started < 5
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens there
    started = time.monotonic()
    assert launch.answering(Place(0, 0, 3, 1, 0), wait_s=0.5) is None
    assert time.monotonic() - started < 5
