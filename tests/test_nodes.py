"""Two nodes on one machine, as the test of the multi-node path: two torchrun launches that meet
at a c10d rendezvous (the command docs/multi-gpu.md gives) train as one process does at the
same global batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    SAME_RUN_LOSS_ATOL,
    TRAIN_SUBPROCESS_TIMEOUT_S,
    losses_and_evaluations,
    write_tone_dataset,
)

from whisper_train.config import RunConfig
from whisper_train.training.train import train


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_node(
    node_rank: int, port: int, train_flags: list[str], launcher: str = "torch.distributed.run"
) -> list[str]:
    """One node's launch: torchrun with 1 process here, 2 nodes in all, meeting at 127.0.0.1.
    `launcher`: torchrun's module, or whisper-train's (`whisper_train.training.launch`: the same
    options, without torchrun's own report of a failed process)."""
    return [
        sys.executable,
        "-m",
        launcher,
        "--nnodes=2",
        f"--node-rank={node_rank}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "-m",
        "whisper_train",
        "train",
        *train_flags,
    ]


def run_nodes(train_flags: list[str]) -> list[str]:
    """Both nodes to their end (a hang fails the test, and stops them); their outputs."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    port = free_port()
    nodes = [
        subprocess.Popen(
            torchrun_node(rank, port, train_flags),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=TRAIN_SUBPROCESS_TIMEOUT_S)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-3000:]
    return outputs


def tiny_run_settings(tmp_path: Path, model_dir: Path) -> dict[str, object]:
    """The run that nodes train and one process trains again: 12 tone clips, 3 steps, seeded
    (RunConfig's names; `as_flags` gives them as `train`'s options)."""
    return {
        "data": str(write_tone_dataset(tmp_path / "data", n=12)),
        "model": str(model_dir),
        "learning_rate": 1e-3,
        "seed": 0,
        "max_steps": 3,
        "lr_scheduler": "constant_with_warmup",
        "nonspeech": "none",
    }


def as_flags(settings: dict[str, object]) -> list[str]:
    return [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()]


def assert_trains_as_one_process(settings: dict[str, object], nodes_dir: Path, one_dir: Path):
    """The run in `nodes_dir` (2 processes at batch 2, `settings` and --only-train) has every
    step's loss of one process at batch 4, trained here into `one_dir`."""
    config = RunConfig()
    config.update({**settings, "only_train": True, "batch_size": 4, "output_dir": str(one_dir)})
    single = train(config)
    nodes_losses, _ = losses_and_evaluations(nodes_dir)
    one_losses, _ = losses_and_evaluations(single.output_dir)
    assert len(nodes_losses) == len(one_losses) == settings["max_steps"]
    np.testing.assert_allclose(nodes_losses, one_losses, rtol=0, atol=SAME_RUN_LOSS_ATOL)


@pytest.mark.long
def test_two_localhost_nodes_equal_one_process(tmp_path, tiny_whisper_dir):
    settings = tiny_run_settings(tmp_path, tiny_whisper_dir)
    # 2 nodes x 1 process x batch 2 = one process at batch 4 (the default packing).
    two = tmp_path / "two"
    outputs = run_nodes(
        [*as_flags(settings), "--only-train", "--batch-size=2", f"--output-dir={two}"]
    )
    assert_trains_as_one_process(settings, two, tmp_path / "one")
    # Written once, by the process that owns them (global rank 0: c10d numbers the nodes
    # itself, so that may be either launcher's).
    assert (two / "final" / "model.safetensors").is_file()
    assert sum("fine-tuned model:" in output for output in outputs) == 1
